"""Qwen3-VL vision transformer: Conv3d patch embedding with bias plus a learned position table
resampled bilinearly to each image's grid, 2-D rotary, full attention within each image,
LayerNorm blocks with a GELU-tanh MLP, the main merger, and deepstack mergers (norm after the
2x2 gathering) on the outputs of the blocks named by `deepstack_visual_indexes`.

Outside the graph (`embed`): the patch embedding and the position embedding, both written into
the graph's static input; a grid's resampled position rows are computed once and kept on the
device (images of one size share them). Inside (`forward_blocks`): blocks and all mergers; the
result is [merged, 1 + levels, out_dim]: level 0 is the main merger's output (the language
model's input embeddings), level l the l-th deepstack features. One tensor, so the encoder
cache, the chunked prefill's row slicing and the graph's output copy treat all levels at once.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from einops import rearrange
from mmpipe.vision.attention import VisionAttention
from mmpipe.vision.layers import LayerNormMerger, run_blocks
from mmpipe.vision.metadata import Grid, Segments, VisionPackMeta
from mmpipe.vision.qwen2_vl import FullAttentionVisionConfig, Qwen2VisionTransformer
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.graphs.transfer import to_device
from mmpipe.layers.weight_map import WeightMap

_POSITION_CACHE = 64  # grids whose resampled position rows stay on the device


def qwen3_vision_config(cfg: dict[str, Any]) -> FullAttentionVisionConfig:
    vc = cfg.get("vision_config") or {}
    try:
        return FullAttentionVisionConfig(
            depth=int(vc["depth"]), hidden_size=int(vc["hidden_size"]),
            intermediate_size=int(vc["intermediate_size"]), num_heads=int(vc["num_heads"]),
            out_hidden_size=int(vc["out_hidden_size"]), in_channels=int(vc.get("in_channels", 3)),
            patch_size=int(vc.get("patch_size", 16)), temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
            hidden_act=str(vc.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            num_position_embeddings=int(vc["num_position_embeddings"]),
            deepstack_visual_indexes=tuple(int(i) for i in vc.get("deepstack_visual_indexes") or ()),
        ).check()
    except KeyError as exc:
        raise CheckpointError(f"config.json: vision_config lacks {exc.args[0]!r}") from None


@lru_cache(maxsize=1024)
def bilinear_taps(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """For each patch of an h x w grid in merge-block order: the 4 rows of a side x side table
    that bilinear resampling (align_corners) reads, and their float32 weights (transformers'
    `get_vision_interpolation_indices_and_weights`, in the same float32 arithmetic)."""
    rows = rearrange(np.arange(h), "(bh m) -> bh m", m=merge)
    cols = rearrange(np.arange(w), "(bw m) -> bw m", m=merge)
    row = np.broadcast_to(rows[:, None, :, None], (h // merge, w // merge, merge, merge)).reshape(-1)
    col = np.broadcast_to(cols[None, :, None, :], (h // merge, w // merge, merge, merge)).reshape(-1)
    row_taps, row_weights = _axis_taps(row, h, side)
    col_taps, col_weights = _axis_taps(col, w, side)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return index, weight


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.clip(np.float32(1) - distance, 0, None).astype(np.float32)


class Qwen3VisionTransformer(Qwen2VisionTransformer):
    patch_bias = True

    def __init__(self, cfg: FullAttentionVisionConfig, attention: VisionAttention | None = None) -> None:
        super().__init__(cfg, attention)
        self.side = int(round(cfg.num_position_embeddings**0.5))
        if self.side * self.side != cfg.num_position_embeddings:
            raise CheckpointError(f"config.json: num_position_embeddings {cfg.num_position_embeddings} is not a "
                                  "square")
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.deepstack_index = {block: level for level, block in enumerate(cfg.deepstack_visual_indexes)}
        self.deepstack_merger_list = nn.ModuleList(
            LayerNormMerger(cfg.hidden_size, cfg.out_hidden_size, cfg.spatial_merge_size, postshuffle=True)
            for _ in cfg.deepstack_visual_indexes)
        self._positions: OrderedDict[Grid, torch.Tensor] = OrderedDict()

    @property
    def levels(self) -> int:
        """Feature levels per merged row: the main one and one per deepstack merger."""
        return 1 + len(self.deepstack_merger_list)

    # ---- outside the graph

    def embed(self, pixel_values: torch.Tensor, patch_order: torch.Tensor, meta: VisionPackMeta | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Patch embedding plus each image's resampled position rows (rounded to the model dtype,
        then added, as transformers does)."""
        if meta is None:
            raise ValueError("Qwen3-VL's patch embedding needs the pack's grids")
        hidden = super().embed(pixel_values, patch_order, meta, out)
        parts = [self.position_rows(grid) for grid in meta.grids]
        if parts:
            hidden.add_(parts[0] if len(parts) == 1 else torch.cat(parts))
        return hidden

    def position_rows(self, grid: Grid) -> torch.Tensor:
        """The learned table resampled to a t x h x w grid, [t*h*w, hidden] in the model dtype."""
        cached = self._positions.get(grid)
        if cached is not None:
            self._positions.move_to_end(grid)
            return cached
        t, h, w = grid
        index, weight = bilinear_taps(h, w, self.cfg.spatial_merge_size, self.side)
        table = self.pos_embed.weight
        index_d, weight_d = to_device(index, table.device), to_device(weight, table.device)
        rows = torch.zeros(index.shape[0], table.shape[1], dtype=torch.float32, device=table.device)
        for tap in range(4):  # float32 sum of the four weighted rows, as transformers sums them
            rows += table.index_select(0, index_d[:, tap]) * weight_d[:, tap, None]
        rows = rows.to(table.dtype)
        if t > 1:
            rows = rows.repeat(t, 1)
        self._positions[grid] = rows
        if len(self._positions) > _POSITION_CACHE:
            self._positions.popitem(last=False)
        return rows

    # ---- the graph region

    def forward_blocks(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full: Segments,
                       windows: Segments | None = None, merged_inverse: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks, the deepstack mergers after their blocks, the main merger: [N / unit, levels, out_dim]."""
        taps = {block: self.deepstack_merger_list[level] for block, level in self.deepstack_index.items()}
        _, normed, features = run_blocks(self.blocks, hidden, cos, sin, full, self.attention, self.merger.norm, taps)
        return torch.stack([self.merger.project(normed), *features], dim=1)

    # ---- weights

    def weight_map(self) -> WeightMap:
        return WeightMap(self, renames={"patch_embed.proj.": "patch_embed.", "linear_fc1.": "fc1.",
                                        "linear_fc2.": "fc2."})
