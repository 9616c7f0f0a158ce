"""Runs the models for the engine: vision encoding, prefill (extend) and decode forwards, sampling.

It owns the paged KV cache and the attention backends and turns requests into flat token
batches with their attention metadata. It makes no scheduling decisions: callers say which
requests and which token ranges run, and must have given each request enough KV pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from mmpipe.config import EngineConfig, GraphMode, effective_graph_mode, graphs_wanted
from mmpipe.engine.batch import ImageInput, PrefillChunk, build_prefill_inputs
from mmpipe.engine.grammar import fill_masks, masks_of
from mmpipe.step_io import DecodeOutput, PendingDecode, PrefillInputs
from mmpipe.engine.kv_pages import PageAllocator
from mmpipe.engine.request import Request, logprob_dict
from mmpipe.errors import DeviceMemoryError
from mmpipe.graphs import runner as graph_runner
from mmpipe.graphs.memory import SharedPool
from mmpipe.graphs.runner import precompile_cold
from mmpipe.layers.mlp import padded_width
from mmpipe.models import LoadedModel
from mmpipe.startup import StartupReport

log = logging.getLogger("mmpipe")


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


def _graph_detail(stats: dict[str, Any]) -> str:
    """A runner's start-up graphs in a few words (for the start-up line)."""
    if not stats["enabled"]:
        return "no graphs"
    text = f"{stats['graphs']} graphs, capture {stats.get('capture_seconds', 0.0):.1f} s"
    compile_s = stats["detail"].get("compile_seconds")
    return text + (f", tracing {compile_s:.1f} s" if compile_s else "")


class ModelRunner:
    def __init__(self, model: LoadedModel, cfg: EngineConfig, startup: StartupReport | None = None,
                 startup_sampling: Any = None) -> None:
        """`startup_sampling`: resolved sampling settings whose decode-graph variants are captured
        at start-up instead of greedy's (a run that knows its sampling, such as the captioning
        tool, captures one set of graphs rather than greedy's and then its own)."""
        self.model, self.cfg = model, cfg
        startup = startup if startup is not None else StartupReport()
        self.device, self.dtype = model.device, model.dtype
        self.graph_mode: GraphMode = effective_graph_mode(cfg.graph_mode, self.device)
        lm = model.language
        self.page_size = cfg.kv_page_size
        family = model.spec
        with startup.phase("KV cache"):
            num_pages = self._num_pages()
            if model.tp is not None:  # every rank's cache holds the pages rank 0's scheduler hands out
                num_pages = model.tp.agree_min(num_pages, self.device)
            # Graphs bake in the KV cache's addresses: it is allocated once and never reallocated.
            self.kv = family.kv_cache(lm.num_layers, num_pages, self.page_size, lm.num_kv_heads, lm.head_dim,
                                      self.dtype, self.device)
        self.pages = PageAllocator(num_pages)
        self.vit_runner = self._make_vit_runner()
        self.vision_sharded = getattr(model.vision, "tp", None) is not None  # vit_parallel="tensor"
        if self.vision_sharded:  # its graphs hold collectives
            self.vit_runner.lockstep = True
        self._vision_stream_on = False
        self._vision_stream = self._make_vision_stream()
        capacity = self.pages.capacity * self.page_size
        limit = cfg.max_model_len or lm.cfg.max_position_embeddings
        self.max_model_len = min(limit, capacity)
        self.stats = RunnerStats()
        log.info("KV cache: %d pages of %d tokens (%d tokens, %.1f MiB); max_model_len %d; graph mode %s",
                 num_pages, self.page_size, capacity,
                 self.kv.nbytes / 2**20, self.max_model_len,
                 self.graph_mode.value)
        mode = self.graph_mode
        # One graph pool for the language model: prefill pieces (largest sizes) captured first,
        # then the decode buckets reuse its blocks.
        prefill_graphs = graphs_wanted(mode, "prefill", cfg.prefill_graph)
        decode_graphs = graphs_wanted(mode, "decode", cfg.decode_graph)
        pool = SharedPool() if graph_runner.can_capture_on(self.device) and (prefill_graphs or decode_graphs) else None
        # Piecewise: the prefill forward is compiled (and split) whenever its mode or config asks.
        with startup.phase("prefill graphs", merge=True):
            self.prefiller = family.prefill_runner(lm, self.kv, self.device, cfg.max_prefill_tokens, prefill_graphs,
                                                   replace(cfg.prefill_graph, enabled=prefill_graphs),
                                                   cfg.prefill_compiler, cfg.compile_cache_dir, memory=pool,
                                                   max_model_len=self.max_model_len)
            self.prefiller.lockstep = model.tp is not None
        with startup.phase("decode graphs", merge=True):
            self.decoder = family.decode_runner(lm, self.kv, cfg.max_running_requests, self.max_model_len,
                                                self.device, replace(cfg.decode_graph, enabled=decode_graphs),
                                                ban_width=cfg.max_banned_tokens, memory=pool)
            self.decoder.lockstep = model.tp is not None
            self.decoder.startup_sampling = startup_sampling
        if self.prefiller.startup_keys() or self.decoder.startup_keys():
            # Where Triton's cache is cold (precompile_cold probes): every start-up kernel, and the
            # vision path's, compiled at once before any capture.
            with startup.phase("Triton precompile"):
                precompile_cold([self.prefiller, self.decoder],
                                self._vision_dry_run if model.tp is None and not self.vision_sharded else None)
        with startup.phase("prefill graphs", merge=True) as phase:
            self.prefiller.capture_all(progress=cfg.startup_progress)
            phase.detail = _graph_detail(self.prefiller.stats())
        with startup.phase("decode graphs", merge=True) as phase:
            if startup_sampling is not None:
                self.decoder.capture_sampling(startup_sampling, progress=cfg.startup_progress)
            else:
                self.decoder.capture_all(progress=cfg.startup_progress)
            phase.detail = _graph_detail(self.decoder.stats())

    def _make_vit_runner(self) -> Any:
        cfg, vit = self.cfg, self.model.vision
        family = self.model.spec
        buckets = cfg.vit_graph.buckets or family.vit_buckets(cfg.max_vision_patches, vit.cfg.merge_unit)
        return family.vit_runner(vit, self.device, buckets, cfg.vit_graph.max_graphs, cfg.vit_graph.memory,
                              cfg.vit_graph_max_images, wanted=graphs_wanted(self.graph_mode, "vit", cfg.vit_graph))

    def _make_vision_stream(self) -> "torch.cuda.Stream | None":
        wanted = self.cfg.vision_stream
        if self.vision_sharded:
            # A tensor-parallel tower's collectives share the language model's communicator, whose
            # collectives must run one after another, in the same order on every rank.
            if wanted:
                log.info("vision_stream is off with vit_parallel='tensor': the vision encoder runs in line")
            return None
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

    def close(self) -> None:
        """Release graphs (before their memory), then the KV cache."""
        for name in ("vit_runner", "decoder", "prefiller"):
            runner = getattr(self, name, None)
            if runner is not None:
                runner.close()
                setattr(self, name, None)
        self.kv = None  # type: ignore[assignment]

    def parallel_stats(self) -> dict[str, Any]:
        """Tensor parallelism (none here: one process holds the whole model)."""
        return {"size": 1}

    def graph_stats(self) -> dict[str, Any]:
        """Graph statistics of the ViT and the language model (one shape each, see
        `mmpipe.graphs.runner.GraphRunner.stats`), for `Pipeline.stats()`."""
        off = {"enabled": False, "graphs": 0}
        return {"graph_mode": self.graph_mode.value,
                **{name: runner.stats() if runner is not None else off
                   for name, runner in (("decode", self.decoder), ("prefill", self.prefiller),
                                        ("vit", self.vit_runner))}}

    # ------------------------------------------------------------------ sizing

    def _num_pages(self) -> int:
        cfg, lm = self.cfg, self.model.language
        if cfg.num_kv_pages is not None:
            return cfg.num_kv_pages
        if self.device.type == "cpu":
            return max(2, cfg.cpu_kv_tokens // self.page_size + 1)
        per_page = self.model.spec.kv_cache.bytes_per_page(lm.num_layers, self.page_size, lm.num_kv_heads, lm.head_dim, self.dtype)
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = self._activation_reserve()
        budget = int(total * cfg.kv_memory_fraction) - (total - free) - reserve
        pages = budget // per_page
        # Never more than every running request at full length could use.
        longest = cfg.max_model_len or lm.cfg.max_position_embeddings
        pages = min(pages, cfg.max_running_requests * -(-longest // self.page_size) + 1)
        if pages < 2:
            gib = 2**30
            raise DeviceMemoryError(
                f"not enough GPU memory: {free / gib:.2f} GiB free of {total / gib:.1f} GiB once the weights were "
                f"loaded; the engine needs {reserve / gib:.2f} GiB for activations and graphs plus at least "
                f"{2 * per_page / gib:.3f} GiB of KV cache, within kv_memory_fraction={cfg.kv_memory_fraction} of the "
                "device; free GPU memory (other processes), raise kv_memory_fraction or lower max_prefill_tokens, "
                "max_vision_patches or max_running_requests")
        return int(pages)

    def _activation_reserve(self) -> int:
        """Peak temporary memory of the largest prefill and vision call, plus the decode graphs
        (logits of the largest batch and the repetition mask) and the deepstack input buffers,
        with margin."""
        lm, vit = self.model.language, self.model.vision.cfg
        elem = torch.empty(0, dtype=self.dtype).element_size()
        tokens = self.cfg.max_prefill_tokens
        qkv = (lm.cfg.num_heads + 2 * lm.num_kv_heads) * lm.head_dim
        text = tokens * (3 * padded_width(lm.cfg.intermediate_size) + 6 * lm.hidden_size + qkv) * elem
        patches = self.cfg.max_vision_patches
        vision = patches * (3 * padded_width(vit.intermediate_size) + 8 * vit.hidden_size) * elem + patches * vit.head_dim * 16
        decode = self.cfg.max_running_requests * lm.vocab_size * (4 * 4 + 1)
        # The prefill runner's deepstack buffers (Qwen3-VL), allocated after the KV cache is sized.
        deepstack = getattr(lm, "deepstack_levels", 0) * tokens * lm.hidden_size * elem
        return 2 * max(text, vision) + decode + deepstack + (512 << 20)

    # ------------------------------------------------------------------ vision

    @torch.inference_mode()
    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
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

    def capture_vision(self, grids: Sequence[tuple[int, int, int]]) -> int:
        """Capture the ViT graphs packs of images of these grids will use (see
        `ViTGraphRunner.capture_packs`); the number captured."""
        if not grids or self.vit_runner is None:
            return 0
        return self.vit_runner.capture_packs(grids, self.cfg.max_vision_patches, progress=self.cfg.startup_progress)

    def _vision_dry_run(self) -> None:
        """One 448 x 448 image through the vision path as a request takes it (preprocessing,
        upload, patchify, rotary tables, the encoder's graph body), nothing captured: run inside
        `precompile_cold`'s compile-only block, it compiles the kernels of a first image request.
        (An image whose sizes specialise a kernel differently compiles that one when it comes.)"""
        from PIL import Image

        spec, vit = self.model.spec, self.model.vision
        image = spec.preprocess(Image.new("RGB", (448, 448), (120, 130, 140)), self.model.image_processor)
        meta = spec.pack_meta([image.grid_thw], vit.cfg.spatial_merge_size, vit.cfg.window_size, vit.cfg.patch_size)
        self.vit_runner.precompile_pack(spec.patches([image], self.device), meta)

    def _encode_packs(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        results: list[torch.Tensor] = []
        pack: list[ImageInput] = []
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

    def run_vision(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        vit = self.model.vision
        meta = self.model.spec.pack_meta([im.grid_thw for im in images], vit.cfg.spatial_merge_size, vit.cfg.window_size,
                               vit.cfg.patch_size)
        # The pack's pixels reach the device as uint8 and become patches there (one queued copy
        # from pinned memory: the host never waits for the step in flight).
        pixels = self.model.spec.patches(images, self.device)
        merged, in_graph_memory = self.vit_runner.forward(pixels, meta)
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
        inputs = build_prefill_inputs(chunks, self.page_size)
        logits = self.forward_prefill(inputs)
        for chunk in chunks:
            chunk.request.num_computed = chunk.end
            if chunk.end >= chunk.request.prompt_len:
                chunk.request.image_embeds = [None] * len(chunk.request.images)  # consumed
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += int(inputs.token_ids.shape[0])
        return logits

    @torch.inference_mode()
    def forward_prefill(self, inputs: PrefillInputs) -> torch.Tensor:
        """The forward of one prefill step's host inputs: logits of its `logit_rows`."""
        hidden, logit_rows = self.prefiller.run_inputs(inputs)
        rows = inputs.logit_rows
        if rows.shape[0] == 1:  # one sequence completes (a first token): a view, not a gather kernel
            return self.model.language.compute_logits(hidden[int(rows[0]):int(rows[0]) + 1])
        return self.model.language.compute_logits(hidden[logit_rows])

    def capture_decode_sampling(self, sampling: Any) -> int:
        """Capture the decode graphs a run with these resolved sampling settings uses (see
        `DecodeGraphRunner.capture_sampling`); the number captured."""
        if self.decoder is None:
            return 0
        return self.decoder.capture_sampling(sampling, self.cfg.startup_progress)

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

    def finish_decode(self, requests: Sequence[Request], pending: PendingDecode) -> None:
        """A constrained decode step launched by `launch_decode` waits for its grammar masks: fill
        them for its requests still running (every token of theirs is on the host by now) and
        queue its sampler. Masks are computed while the GPU runs the step's forward."""
        masks = self.decoder.mask_rows()
        rows = [(r.grammar, int(row)) for r, row in zip(requests, pending.rows)
                if r.grammar is not None and not r.finished]
        fill_masks(rows, masks)
        self._share_masks(masks, sorted(row for _, row in rows))
        self.decoder.finish()

    def _share_masks(self, masks: Any, rows: list[int]) -> None:
        """Hook: tensor parallelism sends the constrained rows' masks to the other ranks."""

    @torch.inference_mode()
    def launch_sample(self, requests: Sequence[Request], logits: torch.Tensor) -> PendingDecode:
        """Queue sampling of one token per request from prefill logits, without waiting for it."""
        masks = None
        if any(r.grammar is not None for r in requests):
            masks = masks_of([r.grammar for r in requests], self.decoder.vocab)
        return self.decoder.sample_logits(requests, logits, masks)
