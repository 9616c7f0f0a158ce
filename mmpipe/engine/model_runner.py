"""Runs the models for the engine: vision encoding, prefill (extend) and decode forwards, sampling.

It owns the paged KV cache and the attention backends and turns requests into flat token
batches with their attention metadata. It makes no scheduling decisions: callers say which
requests and which token ranges run, and must have given each request enough KV pages.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from mmpipe.config import (EngineConfig, GraphConfig, GraphMode, decode_graphs_on, parse_graph_mode,
                           prefill_graphs_on)
from mmpipe.engine.request import Request, logprob_dict
from mmpipe.errors import InputError
from mmpipe.language.attention import AttentionMetadata
from mmpipe.language.decode_graphs import DecodeGraphRunner, DecodeOutput, PendingDecode
from mmpipe.language.kv_cache import DUMMY_PAGE, KVCache, PageAllocator
from mmpipe.language.prefill_graphs import ImageSpan, PrefillRunner
from mmpipe.language.sampler import HostTokens, SampleResult, SamplerTensors, SamplerVariant, sample
from mmpipe.models import LoadedModel
from mmpipe.runtime.layers import padded_width
from mmpipe.runtime.graph_memory import SharedPool
from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
from mmpipe.vision.metadata import build_pack_meta
from mmpipe.vision.preprocess import PreprocessedImage
from mmpipe.runtime.transfer import PackedUploader

log = logging.getLogger("mmpipe")


@dataclass
class PrefillChunk:
    """Tokens [start, end) of a request's sequence, computed in one forward."""

    request: Request
    start: int
    end: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the end of the sequence, so its last row is sampled."""
        return self.end == self.request.total_len


@dataclass
class PrefillInputs:
    """The host side of one prefill forward, plain numpy; `upload` moves it to the device in one
    transfer."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [3, T] int64 (M-RoPE)
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: list[int]  # [B]: cached prefix + new tokens
    query_lens: list[int]  # [B]
    page_table: np.ndarray  # [B, P] int32
    logit_rows: np.ndarray  # [n] int64: rows whose logits are sampled (chunks that complete)
    images: list[ImageSpan]  # rows that take image embeddings, each image's span with its values

    @classmethod
    def build(cls, chunks: Sequence[PrefillChunk], page_size: int) -> "PrefillInputs":
        token_ids, positions, slots, rows, images = [], [], [], [], []
        offset = 0
        for chunk in chunks:
            request, start, end = chunk.request, chunk.start, chunk.end
            token_ids.append(np.asarray(request.tokens(start, end), dtype=np.int64))
            positions.append(request.positions_of(start, end))
            index = np.arange(start, end, dtype=np.int64)
            pages = np.asarray(request.pages, dtype=np.int64)
            slots.append(pages[index // page_size] * page_size + index % page_size)
            for first, image, emb in zip(request.image_starts, request.images, request.image_embeds):
                lo, hi = max(start, first), min(end, first + image.num_tokens)
                if lo >= hi:
                    continue
                if emb is None:
                    raise RuntimeError("image rows scheduled before the image was encoded")
                images.append(ImageSpan(lo - start + offset, emb[lo - first:hi - first]))
            offset += end - start
            if chunk.completes:
                rows.append(offset - 1)
        seq_lens = [c.end for c in chunks]
        width = max(1, -(-max(seq_lens) // page_size))
        table = np.full((len(chunks), width), DUMMY_PAGE, dtype=np.int32)
        for i, chunk in enumerate(chunks):
            count = -(-chunk.end // page_size)
            table[i, :count] = chunk.request.pages[:count]
        if len(chunks) == 1:  # the common step of one chunk: no copies
            ids, pos, slot = token_ids[0], positions[0], slots[0]
        else:
            ids, pos, slot = np.concatenate(token_ids), np.concatenate(positions, axis=1), np.concatenate(slots)
        return cls(ids, pos, slot, seq_lens, [c.end - c.start for c in chunks], table,
                   np.asarray(rows, dtype=np.int64), images)

    def upload(self, uploader: PackedUploader) -> "PrefillTensors":
        """The step's inputs on the uploader's device, through one host-to-device copy (views
        valid for this step's kernels only, see `PackedUploader`)."""
        t = self.token_ids.shape[0]
        ids, pos, slots, logit_rows, count, lens, cu, table = uploader.upload(
            [self.token_ids, self.positions.T, self.slot_mapping, self.logit_rows, np.array([t], dtype=np.int64),
             np.asarray(self.seq_lens, dtype=np.int32),
             np.asarray([0, *itertools.accumulate(self.query_lens)], dtype=np.int32), self.page_table])
        meta = AttentionMetadata(
            is_decode=False, num_tokens=t, slot_mapping=slots, seq_lens=lens, query_start_loc=cu,
            page_table=table, seq_lens_host=self.seq_lens, query_lens_host=self.query_lens,
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens))
        return PrefillTensors(ids, pos, meta, logit_rows, count)


class PrefillTensors(NamedTuple):
    """`PrefillInputs` on the device (views of one copy)."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T, 3] int64, token-major (as the prefill's fixed positions buffer)
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [n] int64
    count: torch.Tensor  # [1] int64 holding T: kernels read it, so their launch does not depend on T


@dataclass
class RunnerStats:
    vision_calls: int = 0
    images_encoded: int = 0
    prefill_forwards: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_host_seconds: float = 0.0  # host time per decode step up to the launch (sum)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ModelRunner:
    def __init__(self, model: LoadedModel, cfg: EngineConfig) -> None:
        self.model, self.cfg = model, cfg
        self.device, self.dtype = model.device, model.dtype
        self.graph_mode: GraphMode = parse_graph_mode(cfg.graph_mode, self.device)
        lm = model.language
        self.page_size = cfg.kv_page_size
        num_pages = self._num_pages()
        # Graphs bake in the KV cache's addresses: it is allocated once and never reallocated.
        self.kv = KVCache(lm.num_layers, num_pages, self.page_size, lm.num_kv_heads, lm.head_dim, self.dtype,
                          self.device)
        self.pages = PageAllocator(num_pages)
        self.vit_graphs = self._make_vit_graphs()
        self._vision_stream_on = False
        self._vision_stream = self._make_vision_stream()
        capacity = self.pages.capacity * self.page_size
        limit = cfg.max_model_len or lm.cfg.max_position_embeddings
        self.max_model_len = min(limit, capacity)
        self.stats = RunnerStats()
        self.uploader = PackedUploader(self.device)  # prefill steps' inputs
        log.info("KV cache: %d pages of %d tokens (%d tokens, %.1f MiB); max_model_len %d; graph mode %s",
                 num_pages, self.page_size, capacity,
                 self.kv.nbytes / 2**20, self.max_model_len,
                 self.graph_mode.value)
        # One graph pool for the language model: prefill pieces (largest sizes) captured first,
        # then the decode buckets reuse its blocks.
        wanted = cfg.prefill_graph.wanted(self.device) or cfg.decode_graph.wanted(self.device)
        pool = SharedPool() if wanted else None
        self.prefiller = PrefillRunner(lm, self.kv, self.device, cfg.max_prefill_tokens,
                                       prefill_graphs_on(self.graph_mode), cfg.prefill_graph, cfg.prefill_compiler,
                                       cfg.compile_cache_dir, memory=pool)
        self.prefiller.capture_all(progress=cfg.startup_progress)
        decode_graphs = cfg.decode_graph if decode_graphs_on(self.graph_mode) else GraphConfig(enabled=False)
        self.decoder = DecodeGraphRunner(lm, self.kv, cfg.max_running_requests, self.max_model_len, self.device,
                                         decode_graphs, ban_width=cfg.max_banned_tokens, memory=pool)
        self.decoder.capture_all(progress=cfg.startup_progress)

    def _make_vit_graphs(self) -> "ViTGraphRunner | None":
        cfg, vit = self.cfg, self.model.vision
        if not cfg.vit_graph.wanted(self.device):
            if cfg.vit_graph.enabled and self.device.type != "cuda":
                log.info("ViT graphs need CUDA; the vision encoder runs eagerly on %s", self.device)
            return None
        if not getattr(vit.attention, "graph_safe", False):
            log.info("ViT graphs off: the %s attention path (%s) cannot be captured; running eagerly",
                     vit.attention.name, str(self.dtype).removeprefix("torch."))
            return None
        buckets = cfg.vit_graph.buckets or default_buckets(cfg.max_vision_patches, vit.cfg.merge_unit)
        return ViTGraphRunner(vit, self.device, buckets, cfg.vit_graph.max_graphs, cfg.vit_graph.memory,
                              cfg.vit_graph_max_images)

    def _make_vision_stream(self) -> "torch.cuda.Stream | None":
        wanted = self.cfg.vision_stream
        if self.device.type != "cuda":
            if wanted:
                log.info("vision_stream needs CUDA; the vision encoder runs in line on %s", self.device)
            return None
        # One stream for the runner's life (streams come from a small process-wide pool: creating
        # one per switch could land on the capture stream). It starts after the start-up work
        # queued so far (the ViT's static buffers are zeroed on the current stream).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._vision_stream_on = wanted is None or wanted
        return stream

    @property
    def vision_stream(self) -> "torch.cuda.Stream | None":
        """The ViT's stream, or None when the ViT runs on the caller's stream."""
        return self._vision_stream if self._vision_stream_on else None

    def use_vision_stream(self, on: bool) -> None:
        """Switch the vision stream on or off between steps (benchmarks compare both in one
        process; not while another thread steps the engine). The device is synchronised first:
        the ViT's static buffers then have no work queued on the stream that stops using them."""
        if on and self._vision_stream is None:
            raise InputError(f"vision_stream needs CUDA, not {self.device}")
        if on != self._vision_stream_on:
            torch.cuda.synchronize(self.device)
            self._vision_stream_on = on

    def close(self) -> None:
        """Release graphs (before their memory), then the KV cache."""
        if self.vit_graphs is not None:
            self.vit_graphs.close()
            self.vit_graphs = None
        if getattr(self, "decoder", None) is not None:
            self.decoder.close()
            self.decoder = None  # type: ignore[assignment]
        if getattr(self, "prefiller", None) is not None:
            self.prefiller.close()
            self.prefiller = None  # type: ignore[assignment]
        self.kv = None  # type: ignore[assignment]

    def graph_stats(self) -> dict[str, Any]:
        """Graph statistics of the ViT and the language model, for `Pipeline.stats()`."""
        decode = self.decoder
        graphs = decode.graph_stats.as_dict() if decode is not None and decode.graph_stats is not None else {}
        decode_stats = {"enabled": bool(graphs), "buckets": list(decode.buckets) if graphs else [],
                        "graphs": graphs.get("graphs_live", 0), **graphs,
                        **(decode.stats.__dict__ if decode is not None else {})}
        vit = self.vit_graphs
        return {
            "graph_mode": self.graph_mode.value,
            "decode": decode_stats,
            "prefill": self.prefiller.graph_stats() if self.prefiller is not None else {"enabled": False, "graphs": 0},
            "vit": ({"enabled": True, "graphs": vit.stats.graphs_live, **vit.stats.as_dict()} if vit is not None
                    else {"enabled": False, "graphs": 0}),
        }

    # ------------------------------------------------------------------ sizing

    def _num_pages(self) -> int:
        cfg, lm = self.cfg, self.model.language
        if cfg.num_kv_pages is not None:
            return cfg.num_kv_pages
        if self.device.type == "cpu":
            return max(2, cfg.cpu_kv_tokens // self.page_size + 1)
        per_page = KVCache.bytes_per_page(lm.num_layers, self.page_size, lm.num_kv_heads, lm.head_dim, self.dtype)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * cfg.kv_memory_fraction) - (total - free) - self._activation_reserve()
        pages = budget // per_page
        # Never more than every running request at full length could use.
        longest = cfg.max_model_len or lm.cfg.max_position_embeddings
        pages = min(pages, cfg.max_running_requests * -(-longest // self.page_size) + 1)
        if pages < 2:
            raise MemoryError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                              f"{total / 2**30:.1f} GiB; raise kv_memory_fraction or lower max_prefill_tokens")
        return int(pages)

    def _activation_reserve(self) -> int:
        """Peak temporary memory of the largest prefill and vision call, plus the decode graphs
        (logits of the largest batch and the repetition mask), with margin."""
        lm, vit = self.model.language, self.model.vision.cfg
        elem = torch.empty(0, dtype=self.dtype).element_size()
        tokens = self.cfg.max_prefill_tokens
        qkv = (lm.cfg.num_heads + 2 * lm.num_kv_heads) * lm.head_dim
        text = tokens * (3 * padded_width(lm.cfg.intermediate_size) + 6 * lm.hidden_size + qkv) * elem
        patches = self.cfg.max_vision_patches
        vision = patches * (3 * padded_width(vit.intermediate_size) + 8 * vit.hidden_size) * elem + patches * vit.head_dim * 16
        decode = self.cfg.max_running_requests * lm.vocab_size * (4 * 4 + 1)
        return 2 * max(text, vision) + decode + (512 << 20)

    # ------------------------------------------------------------------ vision

    @torch.inference_mode()
    def encode_images(self, images: Sequence[PreprocessedImage]) -> list[torch.Tensor]:
        """Merged embeddings [tokens, hidden] per image, packed into ViT calls of at most
        `max_vision_patches` patches (an image larger than that runs alone).

        With the vision stream, the ViT work is queued there, so it runs beside whatever the
        current stream still has queued (the previous step's prefill and decode, with overlapped
        scheduling); the current stream then waits for it on the device before anything after
        this call, which is what reads the embeddings. Each embedding is also marked as used by
        the current stream: when it is freed (consumed, or evicted from the encoder cache), its
        memory goes back to the vision stream's pool only once the current stream's work queued
        by then is done, never to a ViT call that would overwrite it under a prefill still queued."""
        side = self.vision_stream
        if side is None:
            return self._encode_packs(images)
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(side):
            results = self._encode_packs(images)
        main.wait_stream(side)
        for embeds in results:
            embeds.record_stream(main)
        return results

    def _encode_packs(self, images: Sequence[PreprocessedImage]) -> list[torch.Tensor]:
        results: list[torch.Tensor] = []
        pack: list[PreprocessedImage] = []
        patches = 0
        for image in images:
            if pack and patches + image.num_patches > self.cfg.max_vision_patches:
                results += self.run_vision(pack)
                pack, patches = [], 0
            pack.append(image)
            patches += image.num_patches
        if pack:
            results += self.run_vision(pack)
        return results

    def encode_requests(self, requests: Sequence[Request]) -> None:
        """Encode every image of these requests that has no embeddings yet."""
        todo = [(r, i) for r in requests for i, e in enumerate(r.image_embeds) if e is None]
        for (request, index), embeds in zip(todo, self.encode_images([r.images[i] for r, i in todo])):
            request.image_embeds[index] = embeds

    def run_vision(self, images: Sequence[PreprocessedImage]) -> list[torch.Tensor]:
        vit = self.model.vision
        meta = build_pack_meta([im.grid_thw for im in images], vit.cfg.spatial_merge_size, vit.cfg.window_size,
                               vit.cfg.patch_size)
        parts = [im.pixel_values for im in images]
        if self.device.type == "cuda":
            # Packed into pinned memory, the copy is queued without the host waiting for the GPU
            # to reach it (megabytes per image: from pageable memory it would block the host
            # until the step in flight is done, undoing overlapped scheduling).
            pinned = torch.empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), dtype=parts[0].dtype,
                                 pin_memory=True)
            pixels = torch.cat(parts, out=pinned).to(self.device, non_blocking=True)
        else:
            pixels = torch.cat(parts)
        merged = self.vit_graphs.encode(pixels, meta) if self.vit_graphs is not None else None
        in_graph_memory = merged is not None
        if merged is None:
            merged = vit(pixels, meta)
        self.stats.vision_calls += 1
        self.stats.images_encoded += len(images)
        if len(images) == 1 and not in_graph_memory:
            return [merged]
        # Copies: graph outputs must leave graph memory before the next replay, and caching one
        # image's embeddings must not keep a whole pack alive.
        return [part.clone() for part in merged.split(meta.tokens_per_image)]

    # ------------------------------------------------------------------ language model

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Run the chunks as one extend forward; returns logits [n, vocab] for the chunks that
        complete their sequence, in order."""
        inputs = PrefillInputs.build(chunks, self.page_size)
        ids, positions, meta, logit_rows, count = inputs.upload(self.uploader)
        hidden = self.prefiller.forward(ids, positions, inputs.images, meta, count)
        for chunk in chunks:
            chunk.request.num_computed = chunk.end
            if chunk.end >= chunk.request.prompt_len:
                chunk.request.image_embeds = [None] * len(chunk.request.images)  # consumed
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += int(inputs.token_ids.shape[0])
        rows = inputs.logit_rows
        if rows.shape[0] == 1:  # one sequence completes (a first token): a view, not a gather kernel
            return self.model.language.compute_logits(hidden[int(rows[0]):int(rows[0]) + 1])
        return self.model.language.compute_logits(hidden[logit_rows])

    @torch.inference_mode()
    def decode(self, requests: Sequence[Request]) -> None:
        """One token for each request (its last sampled one is fed), sampled inside the step and
        appended to the request (which may finish it)."""
        self.apply_tokens(requests, self.launch_decode(requests).get())

    def launch_decode(self, requests: Sequence[Request]) -> PendingDecode:
        """Queue one decode step (sampling inside) without waiting for its tokens."""
        pending = self.decoder.launch(requests)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(requests)
        self.stats.decode_host_seconds = self.decoder.host_seconds
        for request in requests:
            request.num_computed = request.seq_len
        return pending

    @staticmethod
    def apply_tokens(requests: Sequence[Request], out: DecodeOutput) -> None:
        """Append each request's sampled token (and log-probabilities), which may finish it."""
        for i, request in enumerate(requests):
            k = request.sampling.logprobs
            lp = None
            if k and out.top_ids is not None:
                lp = logprob_dict(out.tokens[i], out.token_logprobs[i], out.top_ids[i],  # type: ignore[index]
                                  out.top_logprobs[i], k)  # type: ignore[index]
            request.append_token(out.tokens[i], lp)

    def release(self, requests: Sequence[Request]) -> None:
        """Finished requests leave the decode batch (no reference to them is kept)."""
        self.decoder.release(requests)

    # ------------------------------------------------------------------ sampling

    @torch.inference_mode()
    def sample(self, requests: Sequence[Request], logits: torch.Tensor) -> None:
        """Sample one token per request from prefill logits and append it (which may finish it)."""
        self.apply_tokens(requests, self.launch_sample(requests, logits).get())

    @torch.inference_mode()
    def launch_sample(self, requests: Sequence[Request], logits: torch.Tensor) -> PendingDecode:
        """Queue sampling of one token per request from prefill logits, without waiting for it."""
        rows = [r.row_sampling() for r in requests]
        variant = SamplerVariant.of(rows)
        # Greedy rows need no per-row tensors: no transfers between the logits and the argmax.
        tensors = SamplerTensors.build(rows, logits.shape[-1], self.device) if variant.needs_tensors else None
        result: SampleResult = sample(logits, tensors, variant)
        return PendingDecode(HostTokens(result, len(requests), variant.logprobs > 0),
                             np.arange(len(requests), dtype=np.int64))
