"""Lazy CUDA graphs for the vision encoder, keyed by bucketed patch count.

Captured region: every ViT block and the patch mergers (Qwen3-VL: the main one and the deepstack
ones, returned together as [merged, levels, dim]), plus the un-permutation of merged rows.
Outside it, per call: patch embedding (with Qwen3-VL's interpolated position embedding), rotary
tables, window order (towers with windowed blocks), and segment boundaries,
written into static buffers that were allocated once at the largest bucket and are only sliced.

A pack of images with N patches runs in the graph of the smallest bucket >= N (captured the
first time it is needed). Rows N..bucket are padding: they form their own segments (chopped to
the window size in windowed blocks), so they never mix with real rows, and their output is
dropped. Segment boundaries live in fixed-length device buffers read by the kernel at replay,
so any mix of image sizes with the same bucket replays the same graph exactly; a bucket's
buffers have room for every layout it can hold (at most `max_images` images). Packs above the
largest bucket, or when capture is impossible, run eagerly (in `forward`). The caller copies each
replay's merged output into fresh tensors at once, before anything else can run in graph memory
(the aliasing rule of `mmpipe.graphs.cache`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch
from mmpipe.vision.metadata import Segments, VisionPackMeta, build_pack_meta

from mmpipe.graphs.memory import GraphMemory
from mmpipe.graphs.runner import GraphRunner
from mmpipe.graphs.transfer import copy_into, to_device

log = logging.getLogger("mmpipe")


def default_buckets(max_patches: int, unit: int = 4) -> list[int]:
    """Fine steps where images are small, coarser where they are large: 64-patch steps to 1024,
    256 to 4096, 1024 beyond (multiples of the merge unit), up to `max_patches`."""
    sizes: list[int] = []
    size, step = 64, 64
    while size < max_patches:
        sizes.append(size)
        step = 64 if size < 1024 else 256 if size < 4096 else 1024
        size += step
    sizes.append(-(-max_patches // unit) * unit)
    return sorted(set(sizes))


class ViTGraphRunner(GraphRunner):
    """The ViT behind the graph-runner interface: static buffers, `fill`, the captured `body`;
    `forward` runs a pack in its bucket's graph or, when none serves it, eagerly."""

    def __init__(self, vit: Any, device: torch.device, buckets: Sequence[int], max_graphs: int = 32,
                 memory: str = "arena", max_images: int = 64, wanted: bool = True) -> None:
        cfg = vit.cfg
        self.vit = vit
        self.unit = cfg.merge_unit
        super().__init__("ViT", device, {-(-int(b) // self.unit) * self.unit for b in buckets}, wanted,
                         vit.attention, memory, max_graphs)
        self.buckets = self.sizes
        self.max_images = max_images
        # Towers without windowed blocks (window_size None) have no window segments to lay out.
        self.windowed = cfg.window_size is not None
        self.window_merged = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size if self.windowed else 0
        self.window_patches = self.window_merged**2 * self.unit
        if not self.enabled:
            return
        largest = self.buckets[-1]
        dtype = vit.patch_embed.weight.dtype
        # Static inputs, allocated once at the largest bucket, outside any graph memory.
        self.hidden = torch.zeros(largest, cfg.hidden_size, dtype=dtype, device=device)
        self.cos = torch.zeros(largest, cfg.head_dim, dtype=torch.float32, device=device)
        self.sin = torch.zeros(largest, cfg.head_dim, dtype=torch.float32, device=device)
        self.cu_full = torch.zeros(self.full_slots() + 1, dtype=torch.int32, device=device)
        self.cu_window = (torch.zeros(self.window_slots(largest) + 1, dtype=torch.int32, device=device)
                          if self.windowed else None)
        self.inverse = torch.arange(largest // self.unit, dtype=torch.int64, device=device)
        self.identity = self.inverse.clone()  # padding rows map to themselves

    @property
    def memory(self) -> GraphMemory | None:
        return self.cache.memory if self.cache is not None else None

    # ------------------------------------------------------------------ sizes

    def full_slots(self, images: int | None = None) -> int:
        return full_segment_slots(self.max_images if images is None else images)

    def window_slots(self, bucket: int, images: int | None = None) -> int:
        if not self.windowed:
            return 0
        return window_segment_slots(bucket, self.unit, self.window_merged,
                                    self.max_images if images is None else images)

    def bucket_for(self, patches: int, images: int) -> int | None:
        if images > self.max_images:
            return None
        return self.size_for(patches)

    def key_for(self, patches: int, frames: int) -> tuple[int, int] | None:
        """(bucket, image slots): the graph serving a pack. Slots come in a few classes (1, 4, 16,
        max_images frames): the attention kernel launches work for every slot, empty or not (a
        one-image pack in the largest class is measurably slower), so a pack takes the smallest
        class that holds it."""
        bucket = self.bucket_for(patches, frames)
        if bucket is None:
            return None
        return bucket, next(c for c in self.image_classes if c >= frames)

    @property
    def image_classes(self) -> list[int]:
        return sorted({min(c, self.max_images) for c in (1, 4, 16)} | {self.max_images})

    def label(self, key: Any) -> str:
        bucket, images = key
        return f"{bucket} patches / {images} image{'s' if images > 1 else ''}"

    # ------------------------------------------------------------------ running

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, meta: VisionPackMeta) -> tuple[torch.Tensor, bool]:
        """(merged embeddings [N / unit, out_dim] in image order, whether they are a view of graph
        memory: copy those before the next call). Packs no graph serves run eagerly."""
        key = self.key_for(meta.num_patches, len(meta.full_lengths)) if self.enabled else None
        if self.enabled and key is None:
            self.fallback("ViT pack of %d patches / %d images runs eagerly (largest graph bucket %d, max %d "
                          "images)", meta.num_patches, len(meta.grids), self.buckets[-1], self.max_images)
        elif key is not None and not self.fill(pixel_values, meta, *key):
            self.fallback("ViT pack of %d images / %d windows does not fit the segment slots of bucket %d; "
                          "running eagerly", len(meta.grids), len(meta.window_lengths), key[0])
            key = None
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            output, graphed = self.run(key, lambda: self.vit(pixel_values, meta))
        return (output[: meta.num_merged] if graphed else output), graphed

    @torch.inference_mode()
    def precompile_pack(self, pixel_values: torch.Tensor, meta: VisionPackMeta) -> None:
        """What `forward` runs for this pack without capturing or replaying anything: the fill and
        the graph's body (the eager encoder where no graph serves the pack). For compile-only
        blocks (`mmpipe.graphs.runner.precompile_cold`): its outputs are thrown away."""
        key = self.key_for(meta.num_patches, len(meta.full_lengths)) if self.enabled else None
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if key is not None and self.fill(pixel_values, meta, *key):
                with self.capture_guard():
                    self.body(key)()
            else:
                self.vit(pixel_values, meta)

    def fill(self, pixel_values: torch.Tensor, meta: VisionPackMeta, bucket: int, images: int | None = None) -> bool:
        """Write the pack into the static buffers; False if its layout does not fit the bucket
        and its `images` slot class (None: `max_images`)."""
        n, vit = meta.num_patches, self.vit
        pad = bucket - n
        window_pad: list[int] = []
        if self.windowed:
            window_pad = [self.window_patches] * (pad // self.window_patches)
            if pad % self.window_patches:
                window_pad.append(pad % self.window_patches)
        slots, full = self.window_slots(bucket, images), self.full_slots(images)
        if len(meta.window_lengths) + len(window_pad) > slots or len(meta.full_lengths) + 1 > full:
            return False
        order = to_device(meta.patch_order, self.device)
        positions = to_device(meta.positions, self.device)
        vit.embed(pixel_values, order, meta, out=self.hidden[:n])  # straight into the static inputs
        vit.rotary_tables(positions, order, out=(self.cos[:n], self.sin[:n]))
        copy_into(self.cu_full[: full + 1], _boundaries(meta.full_lengths + [pad], full))
        if self.cu_window is not None:
            copy_into(self.cu_window[: slots + 1], _boundaries(meta.window_lengths + window_pad, slots))
        merged = meta.num_merged
        copy_into(self.inverse[:merged], meta.merged_inverse)
        self.inverse[merged: bucket // self.unit].copy_(self.identity[merged: bucket // self.unit])
        return True

    @torch.inference_mode()
    def capture_packs(self, grids: Sequence[tuple[int, int, int]], max_patches: int, progress: bool = False) -> int:
        """Capture now every graph that packs of these images will need: for each grid, packs of
        1..K images of it (K: as many as `max_patches` and `max_images` allow), as the engine
        packs a run of equal-sized images. Each is filled with a real pack layout (zero pixels)
        before its capture. No more than the cache holds (`max_graphs`): the packs of fewest images
        first, the rest captured when first met. Returns the number of graphs captured."""
        if self.cache is None:
            return 0
        from tqdm import tqdm

        from mmpipe.graphs.capture import capture_session

        vit, packs = self.vit, {}
        for grid in dict.fromkeys(tuple(g) for g in grids):
            n = grid[0] * grid[1] * grid[2]
            for k in range(1, min(self.max_images, max_patches // n if n else 0) + 1):
                key = self.key_for(k * n, k)
                if key is not None:
                    packs.setdefault(key, [grid] * k)
        wanted = sorted(packs, key=lambda key: (len(packs[key]), key))
        room = self.cache.max_graphs
        if room is not None and len(wanted) > room:  # more would evict the warm-up's own graphs
            log.info("ViT graphs: %d pack shapes for these image sizes, %d kept (max_graphs); the packs of most "
                     "images are captured when first met", len(wanted), room)
            wanted = wanted[:room]
        for key in wanted:
            self.cache.touch(key)  # kept ahead of other graphs in the least-recently-used order
        missing = [key for key in wanted if self.lookup(key) is None]
        before = self.cache.stats.captures
        with capture_session():
            for key in tqdm(sorted(missing, reverse=True), desc="capturing ViT graphs", unit="graph",
                            disable=not progress, leave=False, dynamic_ncols=True):
                cfg = vit.cfg
                meta = build_pack_meta(packs[key], cfg.spatial_merge_size, cfg.window_size, cfg.patch_size)
                pixels = torch.zeros(meta.num_patches, vit.patch_dim, device=self.device)
                if self.fill(pixels, meta, *key):
                    with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                        self.capture(key, quiet=True)
        return self.cache.stats.captures - before

    def body(self, key: Any) -> Callable[[], torch.Tensor]:
        """The captured region for (bucket, image slots): blocks and merger over the static buffers."""
        bucket, images = key
        full = Segments(self.cu_full[: self.full_slots(images) + 1], bucket, [])
        windows = (Segments(self.cu_window[: self.window_slots(bucket, images) + 1], self.window_patches, [])
                   if self.cu_window is not None else None)
        hidden, cos, sin = self.hidden[:bucket], self.cos[:bucket], self.sin[:bucket]
        inverse = self.inverse[: bucket // self.unit]

        def run() -> torch.Tensor:
            return self.vit.forward_blocks(hidden, cos, sin, full, windows, inverse)

        return run

    def detail(self) -> dict[str, Any]:
        return {"max_images": self.max_images}


def full_segment_slots(max_images: int) -> int:
    """Full-attention segments a pack may have: one per image (frame), plus the padding."""
    return max_images + 1


def window_segment_slots(bucket: int, unit: int, window_merged: int, max_images: int) -> int:
    """Windowed segments a pack of up to `bucket` patches may have. An image of gh x gw merged
    units has ceil(gh/w) * ceil(gw/w) <= m/w^2 + (m + 1)/w + 1 windows (m = gh*gw), so real
    windows <= M/w^2 + (M + images)/w + images with M = bucket/unit merged units (and never more
    than M); padding adds at most bucket/(w^2 unit) + 1 window-sized chunks."""
    merged, w = bucket // unit, window_merged
    real = min(merged, merged // (w * w) + (merged + max_images) // w + max_images + 1)
    return real + bucket // (w * w * unit) + 2


def _boundaries(lengths: Sequence[int], slots: int) -> torch.Tensor:
    """cu_seqlens with exactly `slots` segments: the given ones, then empty ones at the end."""
    if len(lengths) > slots:
        raise ValueError(f"{len(lengths)} segments do not fit the {slots} slots of this bucket")
    cu = np.empty(slots + 1, dtype=np.int32)
    cu[0] = 0
    np.cumsum(lengths, out=cu[1:len(lengths) + 1])
    cu[len(lengths) + 1:] = cu[len(lengths)]
    return torch.from_numpy(cu)


