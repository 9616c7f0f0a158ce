"""Runs the models for the engine: vision encoding, prefill (extend) and decode forwards, sampling.

It owns the paged KV cache and the attention backends and turns requests into flat token
batches with their attention metadata. It makes no scheduling decisions: callers say which
requests and which token ranges run, and must have given each request enough KV pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from mmpipe.language.attention import AttentionMetadata, make_lm_attention
from mmpipe.language.kv_cache import DUMMY_PAGE, KVCache, PageAllocator
from mmpipe.language.sampler import SampleResult, SamplingBatch, sample
from mmpipe.config import EngineConfig
from mmpipe.errors import InputError
from mmpipe.engine.request import Request, logprob_dict
from mmpipe.models import LoadedModel
from mmpipe.runtime.context import ForwardContext, forward_context
from mmpipe.vision.attention import make_vision_attention
from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
from mmpipe.vision.metadata import build_pack_meta
from mmpipe.vision.preprocess import PreprocessedImage

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
class RunnerStats:
    vision_calls: int = 0
    images_encoded: int = 0
    prefill_forwards: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0


class ModelRunner:
    def __init__(self, model: LoadedModel, cfg: EngineConfig) -> None:
        self.model, self.cfg = model, cfg
        self.device, self.dtype = model.device, model.dtype
        lm = model.language
        self.page_size = cfg.kv_page_size
        num_pages = self._num_pages()
        self.kv = KVCache(lm.num_layers, num_pages, self.page_size, lm.num_kv_heads, lm.head_dim, self.dtype,
                          self.device)
        self.pages = PageAllocator(num_pages)
        model.vision.attention = make_vision_attention(cfg.attention_backend, self.device, self.dtype)
        self.vit_graphs = self._make_vit_graphs()
        try:
            self.lm_attention = make_lm_attention(cfg.attention_backend, self.device, self.dtype,
                                                  lm.head_dim**-0.5, cfg.extend_attention)
        except ValueError as exc:
            raise InputError(f"EngineConfig.attention_backend: {exc}") from None
        capacity = self.pages.capacity * self.page_size
        limit = cfg.max_model_len or lm.cfg.max_position_embeddings
        self.max_model_len = min(limit, capacity)
        self.stats = RunnerStats()
        log.info("KV cache: %d pages of %d tokens (%d tokens, %.1f MiB); max_model_len %d", num_pages,
                 self.page_size, capacity, self.kv.storage.numel() * self.kv.storage.element_size() / 2**20,
                 self.max_model_len)

    def _make_vit_graphs(self) -> "ViTGraphRunner | None":
        cfg, vit = self.cfg, self.model.vision
        wanted = cfg.vit_graphs if cfg.vit_graphs is not None else self.device.type == "cuda"
        if not wanted:
            return None
        if self.device.type != "cuda":
            log.info("ViT graphs need CUDA; the vision encoder runs eagerly on %s", self.device)
            return None
        if not getattr(vit.attention, "graph_safe", False):
            log.info("ViT graphs off: the %s attention path (%s) cannot be captured; running eagerly",
                     vit.attention.name, str(self.dtype).removeprefix("torch."))
            return None
        buckets = cfg.vit_graph_buckets or default_buckets(cfg.max_vision_patches, vit.cfg.merge_unit)
        return ViTGraphRunner(vit, self.device, buckets, cfg.vit_graph_max_graphs, cfg.vit_graph_memory,
                              cfg.vit_graph_max_images)

    def close(self) -> None:
        """Release graphs (before their memory), then the KV cache."""
        if self.vit_graphs is not None:
            self.vit_graphs.close()
            self.vit_graphs = None
        self.kv = None  # type: ignore[assignment]

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
        """Peak temporary memory of the largest prefill and vision call, with margin."""
        lm, vit = self.model.language, self.model.vision.cfg
        elem = torch.empty(0, dtype=self.dtype).element_size()
        tokens = self.cfg.max_prefill_tokens
        qkv = (lm.cfg.num_heads + 2 * lm.num_kv_heads) * lm.head_dim
        text = tokens * (3 * lm.cfg.intermediate_size + 6 * lm.hidden_size + qkv) * elem
        patches = self.cfg.max_vision_patches
        vision = patches * (3 * vit.intermediate_size + 8 * vit.hidden_size) * elem + patches * vit.head_dim * 16
        return 2 * max(text, vision) + (512 << 20)

    # ------------------------------------------------------------------ vision

    @torch.inference_mode()
    def encode_images(self, images: Sequence[PreprocessedImage]) -> list[torch.Tensor]:
        """Merged embeddings [tokens, hidden] per image, packed into ViT calls of at most
        `max_vision_patches` patches (an image larger than that runs alone)."""
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
        pixels = torch.cat([im.pixel_values for im in images]).to(self.device, non_blocking=True)
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
        token_ids, positions, rows = [], [], []
        offset = 0
        for chunk in chunks:
            request = chunk.request
            token_ids.extend(request.tokens(chunk.start, chunk.end))
            positions.append(request.positions_of(chunk.start, chunk.end))
            offset += chunk.end - chunk.start
            if chunk.completes:
                rows.append(offset - 1)
        ids = self._to_device(np.asarray(token_ids, dtype=np.int64))
        embeds = self.model.language.embed(ids)
        self._insert_image_embeds(embeds, chunks)
        pos = self._to_device(np.concatenate(positions, axis=1))
        meta = self._extend_metadata(chunks)
        hidden = self._forward(embeds, pos, meta)
        for chunk in chunks:
            chunk.request.num_computed = chunk.end
            if chunk.end >= chunk.request.prompt_len:
                chunk.request.image_embeds = [None] * len(chunk.request.images)  # consumed
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += len(token_ids)
        return self.model.language.compute_logits(hidden[self._to_device(np.asarray(rows, dtype=np.int64))])

    @torch.inference_mode()
    def decode(self, requests: Sequence[Request]) -> torch.Tensor:
        """One token per request (its last sampled one); returns logits [B, vocab]."""
        ids = self._to_device(np.asarray([r.output_ids[-1] for r in requests], dtype=np.int64))
        indices = np.asarray([r.total_len - 1 for r in requests], dtype=np.int64)
        deltas = np.asarray([r.mrope_delta for r in requests], dtype=np.int64)
        pos = self._to_device(np.ascontiguousarray(np.broadcast_to(indices + deltas, (3, len(requests)))))
        meta = self._decode_metadata(requests)
        hidden = self._forward(self.model.language.embed(ids), pos, meta)
        for request in requests:
            request.num_computed = request.total_len
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(requests)
        return self.model.language.compute_logits(hidden)

    def _forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        context = ForwardContext(attn_metadata=meta, kv_caches=self.kv.layers, attention=self.lm_attention)
        with forward_context(context):
            return self.model.language(embeds, positions)

    def _insert_image_embeds(self, embeds: torch.Tensor, chunks: Sequence[PrefillChunk]) -> None:
        rows, values = [], []
        offset = 0
        for chunk in chunks:
            request = chunk.request
            for start, image, emb in zip(request.image_starts, request.images, request.image_embeds):
                lo, hi = max(chunk.start, start), min(chunk.end, start + image.num_tokens)
                if lo >= hi:
                    continue
                if emb is None:
                    raise RuntimeError("image rows scheduled before the image was encoded")
                rows.append(np.arange(lo, hi) - chunk.start + offset)
                values.append(emb[lo - start:hi - start])
            offset += chunk.end - chunk.start
        if rows:
            index = self._to_device(np.concatenate(rows).astype(np.int64))
            embeds.index_copy_(0, index, torch.cat(values).to(embeds.dtype))

    # ------------------------------------------------------------------ metadata

    def _slots(self, request: Request, start: int, end: int) -> np.ndarray:
        idx = np.arange(start, end, dtype=np.int64)
        pages = np.asarray(request.pages, dtype=np.int64)
        return pages[idx // self.page_size] * self.page_size + idx % self.page_size

    def _page_table(self, requests: Sequence[Request], lengths: Sequence[int]) -> torch.Tensor:
        width = max(1, max(-(-n // self.page_size) for n in lengths))
        table = np.full((len(requests), width), DUMMY_PAGE, dtype=np.int32)
        for row, (request, n) in enumerate(zip(requests, lengths)):
            count = -(-n // self.page_size)
            table[row, :count] = request.pages[:count]
        return self._to_device(table)

    def _extend_metadata(self, chunks: Sequence[PrefillChunk]) -> AttentionMetadata:
        q_lens = [c.end - c.start for c in chunks]
        seq_lens = [c.end for c in chunks]
        slots = np.concatenate([self._slots(c.request, c.start, c.end) for c in chunks])
        return self._metadata(False, [c.request for c in chunks], q_lens, seq_lens, slots)

    def _decode_metadata(self, requests: Sequence[Request]) -> AttentionMetadata:
        seq_lens = [r.total_len for r in requests]
        slots = np.concatenate([self._slots(r, r.total_len - 1, r.total_len) for r in requests])
        return self._metadata(True, requests, [1] * len(requests), seq_lens, slots)

    def _metadata(self, is_decode: bool, requests: Sequence[Request], q_lens: list[int], seq_lens: list[int],
                  slots: np.ndarray) -> AttentionMetadata:
        qsl = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        return AttentionMetadata(
            is_decode=is_decode, num_tokens=int(qsl[-1]), slot_mapping=self._to_device(slots),
            seq_lens=self._to_device(np.asarray(seq_lens, dtype=np.int32)),
            query_start_loc=self._to_device(qsl), page_table=self._page_table(requests, seq_lens),
            seq_lens_host=list(seq_lens), query_lens_host=list(q_lens), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ sampling

    @torch.inference_mode()
    def sample(self, requests: Sequence[Request], logits: torch.Tensor) -> None:
        """Sample one token per request and append it (which may finish the request)."""
        batch = self._sampling_batch(requests)
        result: SampleResult = sample(logits, batch)
        tokens = result.tokens.tolist()
        if result.top_ids is None:
            for request, token in zip(requests, tokens):
                request.append_token(token, None)
            return
        chosen, top_ids, top_lps = result.token_logprobs.tolist(), result.top_ids.tolist(), result.top_logprobs.tolist()
        for i, (request, token) in enumerate(zip(requests, tokens)):
            k = request.sampling.logprobs
            lp = logprob_dict(token, chosen[i], top_ids[i], top_lps[i], k) if k else None
            request.append_token(token, lp)

    def _sampling_batch(self, requests: Sequence[Request]) -> SamplingBatch:
        s = [r.sampling for r in requests]
        return SamplingBatch.build(
            temperature=[x.temperature for x in s], top_k=[x.top_k for x in s], top_p=[x.top_p for x in s],
            min_p=[x.min_p for x in s], penalty=[x.repetition_penalty for x in s],
            seeds=[r.seed for r in requests], steps=[len(r.output_ids) for r in requests],
            banned=[r.banned_tokens() for r in requests],
            seen=[r.prompt_ids + r.output_ids if r.sampling.repetition_penalty != 1.0 else [] for r in requests],
            max_logprobs=max(x.logprobs for x in s), device=self.device)
