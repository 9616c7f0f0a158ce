"""The language model's prefill (extend) forward over fixed input buffers, eager or piecewise.

Every prefill reads slices of two buffers allocated once at `max_prefill_tokens` rows:
`input_embeds [max_tokens, hidden]` and `positions [max_tokens, 3]`. Text-token embeddings are
gathered straight into their rows and each image's merged ViT output is copied into its rows (one
copy per image span, no concatenation).

Piecewise mode (graph modes `piecewise`, `full_and_piecewise`): the forward over the buffers is
traced once by `torch.compile` with `mmpipe.runtime.piecewise.PiecewiseBackend`, the token
dimension dynamic, split at the attention op (`mmpipe::lm_attention`, run eagerly on the real
tokens with the step's metadata), and each piece (norms, projections, rotary + KV write, MLP,
residuals) captured as a CUDA graph for every size of the schedule, largest first, into the
language model's shared pool. A step of T tokens runs at the smallest schedule size >= T
(bisection); rows past T are padding: their K/V go to the dummy page (the slots buffer holds the
dummy slot past the step's rows), attention is not computed for them, their outputs are dropped.
Above the largest size the compiled pieces run without graphs. From the second forward at a
size on, the runner replays that size's recorded plan (`mmpipe.runtime.piecewise.ReplayPlan`).
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mmpipe.config import GraphConfig
from mmpipe.language.attention import AttentionMetadata
from mmpipe.language.attention.op import attention
from mmpipe.language.kv_cache import DUMMY_PAGE, KVCache
from mmpipe.language.stage_inputs import stage_rows
from mmpipe.runtime.capture import capture_session, capture_stream
from mmpipe.runtime.context import ForwardContext, forward_context
from mmpipe.runtime.graph_cache import GraphCache, bucket_for
from mmpipe.runtime.graph_memory import GraphMemory, SharedPool, device_memory_in_use
from mmpipe.runtime.piecewise import (PiecewiseBackend, PiecewiseState, default_cache_dir, environment_key,
                                      make_piece_compiler)

log = logging.getLogger("mmpipe")


def default_prefill_schedule(max_tokens: int) -> list[int]:
    """Token counts captured by default (SGLang's schedule): 4-32 step 4, 48-256 step 16,
    288-512 step 32, 576-1024 step 64, 1280-4096 step 256, then step 512; capped by `max_tokens`,
    which is added as the last size so every prefill the scheduler builds has a graph."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256)]
    size = 4608
    while size <= max_tokens:
        sizes.append(size)
        size += 512
    sizes = [s for s in sizes if s <= max_tokens]
    if not sizes or sizes[-1] < max_tokens:
        sizes.append(max_tokens)
    return sizes


@dataclass
class ImageSpan:
    """Rows [row, row + len(values)) of the step take these image embeddings."""

    row: int
    values: torch.Tensor


@dataclass
class PrefillRunnerStats:
    graph_forwards: int = 0  # replays of a captured size
    compiled_forwards: int = 0  # piecewise mode without a graph (above the schedule, a failed size)
    eager_forwards: int = 0  # not compiled (graph modes without piecewise, the CPU)
    padded_tokens: int = 0  # rows added to reach schedule sizes
    schedule_seconds: float = 0.0  # start-up: compiling, warming up and capturing every size
    schedule_memory_bytes: int = 0  # GPU memory the captured schedule holds (driver's view)


class PrefillRunner:
    def __init__(self, lm: Any, kv: KVCache, device: torch.device, max_tokens: int, piecewise: bool,
                 graphs: GraphConfig | None = None, compiler: str = "eager", cache_dir: str | Path | None = None,
                 memory: GraphMemory | None = None) -> None:
        self.lm, self.kv, self.device, self.max_tokens = lm, kv, device, max_tokens
        dtype = lm.embed_tokens.weight.dtype
        # Static buffers, outside graph memory; every forward reads slices of them.
        self.input_embeds = torch.zeros(max_tokens, lm.hidden_size, dtype=dtype, device=device)
        # Token-major, so a slice of the first rows is contiguous at every size (a [3, T] slice of
        # a [3, max] buffer is contiguous only at T = max, and the tracer would see two layouts).
        self.positions = torch.zeros(max_tokens, 3, dtype=torch.int64, device=device)
        # KV slots of the rows; each step sets its padding rows (past its tokens) to the dummy slot.
        self.dummy_slot = DUMMY_PAGE * kv.page_size
        self.slots = torch.full((max_tokens,), self.dummy_slot, dtype=torch.int64, device=device)
        self.stats = PrefillRunnerStats()
        graphs = graphs or GraphConfig(enabled=False)
        schedule = graphs.buckets or default_prefill_schedule(max_tokens)
        self.schedule = sorted({min(int(s), max_tokens) for s in schedule})
        self.graphs_on = piecewise and graphs.wanted(device) and getattr(lm.attention, "graph_safe", False)
        if piecewise and graphs.wanted(device) and not self.graphs_on:
            log.info("prefill graphs off: the %s attention backend cannot be captured", lm.attention.name)
        self.cache: GraphCache | None = None
        if self.graphs_on:
            self.cache = GraphCache("prefill", device, memory or SharedPool(), max_graphs=None)
        self.state = PiecewiseState(self.cache)
        self.backend: PiecewiseBackend | None = None
        self.compiled: Any = None
        self.compiler = compiler
        if piecewise:
            cfg = getattr(lm, "cfg", None)
            env = environment_key({"model": repr(cfg), "dtype": str(dtype), "compiler": compiler,
                                   "device": device.type})
            root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "compile"
            # Dynamo records the op packet; other tracers the overload.
            attention_ops = {torch.ops.mmpipe.lm_attention: attention,
                             torch.ops.mmpipe.lm_attention.default: attention}
            self.backend = PiecewiseBackend(attention_ops,
                                            make_piece_compiler(compiler, root, env), self.state)
            self.compiled = torch.compile(_fresh_forward(lm), backend=self.backend, fullgraph=True)

    # ------------------------------------------------------------------ running

    def size_for(self, num_tokens: int) -> int:
        """Rows the forward runs: the smallest schedule size >= num_tokens; num_tokens above the
        schedule or without compilation."""
        if self.compiled is None:
            return num_tokens
        bucket = bucket_for(self.schedule, num_tokens)
        return num_tokens if bucket is None else bucket

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, images: Sequence[ImageSpan],
                meta: AttentionMetadata, count: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states whose first T rows are the step's tokens (T = len(token_ids)); the
        result may alias graph memory: use it before the next forward. `positions`: token-major
        M-RoPE positions [T, 3] (the layout of the fixed buffer they are copied into). `count`: T
        in a device int64 [1] (with it, the fixed rows are filled by one kernel)."""
        n = token_ids.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"a prefill of {n} tokens exceeds max_prefill_tokens={self.max_tokens}")
        size = self.size_for(n)
        stage_rows(self.lm.embed_tokens.weight, token_ids, positions, meta.slot_mapping, count, self.input_embeds,
                   self.positions, self.slots, size, self.dummy_slot)
        for span in images:
            self.input_embeds[span.row:span.row + span.values.shape[0]].copy_(span.values)
        with forward_context(ForwardContext(meta, self.kv.layers, self.lm.attention)):
            if self.compiled is None:
                self.stats.eager_forwards += 1
                return self.lm(self.input_embeds[:n], self.positions[:n].t(), self.kv.layers, meta.slot_mapping)
            graphed = self.cache is not None and size not in self.state.failed_sizes \
                and (self.state.generation, size, 0) in self.cache
            self.state.size = size if graphed else None
            if graphed:
                self.stats.graph_forwards += 1
                self.stats.padded_tokens += size - n
                return self.state.run_planned(size, lambda: self._run_compiled(size))
            self.stats.compiled_forwards += 1
            return self._run_compiled(size)

    def _run_compiled(self, size: int) -> torch.Tensor:
        embeds, positions = self.input_embeds[:size], self.positions[:size]
        bound = max(self.max_tokens, 3)
        torch._dynamo.mark_dynamic(embeds, 0, min=2, max=bound)
        torch._dynamo.mark_dynamic(positions, 0, min=2, max=bound)
        slots = self.slots[:size]
        torch._dynamo.mark_dynamic(slots, 0, min=2, max=bound)
        return self.compiled(embeds, positions, self.kv.layers, slots)

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> None:
        """Compile (first call), then for every schedule size, largest first: a warm-up forward,
        then a forward in which every piece captures its graph into the shared memory."""
        if self.compiled is None:
            return
        from tqdm import tqdm

        start = time.perf_counter()
        if self.cache is None:  # compiled, no graphs: trace now rather than in the first request
            self._dummy_forward(self.schedule[-1], capture=False)
            log.info("prefill compiled (%s pieces) in %.1f s; no graphs", self.state.num_pieces,
                     time.perf_counter() - start)
            return
        on_cuda = self.device.type == "cuda"
        self.state.drop_plans()  # plans point at graphs: a new capture replaces them
        before = device_memory_in_use(self.device) if on_cuda else 0
        memory = self.cache.memory.open()
        sizes = sorted(self.schedule, reverse=True)
        with capture_session():
            for size in tqdm(sizes, desc="capturing prefill graphs", unit="size", disable=not progress,
                             leave=False, dynamic_ncols=True):
                self._dummy_forward(size, capture=False)  # compiles on the first call; warms this size up
                self.state.memory = memory
                self._dummy_forward(size, capture=True)
        self.state.memory = None
        self.state.size = None
        seconds = time.perf_counter() - start
        after = device_memory_in_use(self.device) if on_cuda else 0
        self.stats.schedule_seconds = seconds
        self.stats.schedule_memory_bytes = max(0, after - before)
        captured = [s for s in sizes if s not in self.state.failed_sizes]
        b = self.backend
        assert b is not None
        log.info("prefill graphs: %d sizes (%d-%d tokens) x %d pieces captured in %.1f s (tracing and %s "
                 "compilation %.1f s, %d compiled, %d loaded from cache); GPU memory %.0f -> %.0f MiB (graphs "
                 "%.0f MiB)", len(captured), min(sizes), max(sizes), self.state.num_pieces, seconds,
                 self.compiler, b.stats.compile_seconds, b.stats.compilations, b.stats.compile_cache_loads,
                 before / 2**20, after / 2**20, (after - before) / 2**20)
        if self.state.failed_sizes:
            log.warning("prefill graphs: %d sizes could not be captured and run without graphs: %s",
                        len(self.state.failed_sizes), sorted(self.state.failed_sizes))

    def _dummy_forward(self, size: int, capture: bool) -> None:
        """A forward of `size` tokens of one fresh sequence whose K/V go to the dummy page."""
        page = self.kv.page_size
        device = self.device
        meta = AttentionMetadata(
            is_decode=False, num_tokens=size,
            slot_mapping=torch.full((size,), DUMMY_PAGE * page, dtype=torch.int64, device=device),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            page_table=torch.full((1, -(-size // page)), DUMMY_PAGE, dtype=torch.int32, device=device),
            seq_lens_host=[size], query_lens_host=[size], max_query_len=size, max_seq_len=size)
        self.slots[:size].fill_(self.dummy_slot)  # a real step's slots may still be there
        stream = capture_stream(device) if device.type == "cuda" else None
        with forward_context(ForwardContext(meta, self.kv.layers, self.lm.attention)):
            self.state.size = size if self.cache is not None else None
            self.state.capturing = capture
            try:
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        self._run_compiled(size)
                    torch.cuda.current_stream(device).wait_stream(stream)
                else:
                    self._run_compiled(size)
            finally:
                self.state.capturing = False
        if stream is not None:
            stream.synchronize()

    # ------------------------------------------------------------------ stats, teardown

    def graph_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"enabled": self.cache is not None, "compiled": self.compiled is not None,
                               "compiler": self.compiler if self.compiled is not None else None,
                               "sizes": list(self.schedule) if self.compiled is not None else [],
                               **self.stats.__dict__}
        if self.backend is not None:
            out.update(self.backend.stats.as_dict())
        if self.cache is not None:
            out.update(self.cache.stats.as_dict())
            out["graphs"] = self.cache.stats.graphs_live
            out["replay_plans"] = len(self.state.plans)
            out["plan_forwards"] = sum(plan.runs for plan in self.state.plans.values())
            out["failed_sizes"] = sorted(self.state.failed_sizes)
        else:
            out["graphs"] = 0
        return out

    def close(self) -> None:
        """Destroy the graphs (the shared memory itself belongs to whoever made it)."""
        if self.cache is not None:
            self.state.drop_plans()
            self.cache.close()
            self.cache = None
            self.state.cache = None
        self.compiled = None


def _fresh_forward(lm: Any) -> Any:
    """`lm.forward` as a function with its own code object. torch.compile keeps compiled code per
    code object: runners of different models (or two Pipelines of one model) would otherwise share
    one cache and count against one recompile limit."""
    def forward(input_embeds: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
        return lm(input_embeds, positions.t(), kv_cache, slot_mapping)  # positions [T, 3] -> [3, T]

    code = forward.__code__.replace(co_name=f"prefill_forward_{id(lm):x}")
    return types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)
