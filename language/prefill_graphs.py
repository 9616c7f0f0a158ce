"""The language model's prefill (extend) forward over fixed input buffers, eager or piecewise.

Every prefill reads slices of two buffers allocated once at `max_prefill_tokens` rows:
`input_embeds [max_tokens, hidden]` and `positions [max_tokens, 3]`. Text-token embeddings are
gathered straight into their rows and each image's merged ViT output is copied into its rows (one
copy per image span, no concatenation). A deepstack model (Qwen3-VL, `lm.deepstack_levels` > 0)
has one more buffer per level, `deepstack[l] [max_tokens, hidden]`: an image span's values are
[rows, 1 + levels, hidden], level 0 going to `input_embeds` and level l to `deepstack[l-1]`. Every
forward reads all the deepstack buffers, whatever the step holds, and rows without image tokens
read zeros there (the rows a step wrote are zeroed again before the next step): a graph captured
on a text-only step replays an image step correctly, because the image path is the only path.

Piecewise mode (graph modes `piecewise`, `full_and_piecewise`): the forward over the buffers is
cut at its attention calls (run eagerly on the real tokens with the step's metadata), and each
piece between two of them (norms, projections, rotary + KV write, MLP, residuals) is captured as a
CUDA graph for every size of the schedule, largest first, into the language model's shared pool.
With the default piece compiler, `eager`, the pieces are captured straight from the eager forward
(`mmpipe.graphs.split_capture`: the capture ends and resumes around each attention call): nothing
is traced, so a start costs one warm-up forward (at the largest size) and a capture forward per
size, and a replay runs the eager forward's exact kernels. With `inductor`, the forward is traced
once by `torch.compile` with `mmpipe.graphs.piecewise.PiecewiseBackend` (token dimension dynamic),
split at the attention op (`mmpipe::lm_attention`) and each piece compiled, then captured the same
way (a warm-up per size). A step of T tokens
runs at the smallest schedule size >= T (bisection); rows past T are padding: their K/V go to the
dummy page (the slots buffer holds the dummy slot past the step's rows), attention is not computed
for them, their outputs are dropped. Above the largest size (by default `max_prefill_tokens`, at
most 8192) the pieces run without graphs, at the step's exact size. A captured size is served
by its replay plan (`mmpipe.graphs.piecewise.ReplayPlan`): its pieces' graphs and the attention
calls between them, in order.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
from mmpipe.language.attention import AttentionMetadata
from mmpipe.language.attention.metadata import host_decode_rows
from mmpipe.language.attention.op import attention
from mmpipe.language.extend_row_graphs import ROW_GRAPH_MAX_TOKENS, RowGraphs
from mmpipe.language.kv_cache import DUMMY_PAGE, KVCache
from mmpipe.language.prefill_schedule import default_prefill_schedule

from mmpipe.config import GraphConfig
from mmpipe.graphs.cache import bucket_for
from mmpipe.graphs.capture import on_capture_stream
from mmpipe.graphs.compile_cache import default_cache_dir, environment_key, make_piece_compiler
from mmpipe.graphs.memory import GraphMemory
from mmpipe.graphs.piecewise import PiecewiseBackend, PiecewiseState
from mmpipe.graphs.runner import GraphRunner
from mmpipe.graphs.split_capture import SplitGraphs
from mmpipe.graphs.transfer import PackedUploader
from mmpipe.kernels.stage_rows import stage_rows
from mmpipe.layers.context import ForwardContext, forward_context
from mmpipe.step_io import ImageSpan, PrefillInputs

log = logging.getLogger("mmpipe")


class PrefillTensors(NamedTuple):
    """A step's `PrefillInputs` on the device (views of one copy)."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T, 3] int64, token-major (as the prefill's fixed positions buffer)
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [n] int64
    count: torch.Tensor  # [1] int64 holding T: kernels read it, so their launch does not depend on T


def upload_inputs(inputs: PrefillInputs, uploader: PackedUploader, rows_up_to: int = 0) -> PrefillTensors:
    """The step's inputs on the uploader's device, through one host-to-device copy (views valid
    for this step's kernels only, see `PackedUploader`). A step of at most `rows_up_to` tokens
    over a longer context also carries its tokens as decode rows (`meta.decode_rows`)."""
    t = inputs.token_ids.shape[0]
    arrays = [inputs.token_ids, inputs.positions.T, inputs.slot_mapping, inputs.logit_rows, np.array([t], dtype=np.int64),
              np.asarray(inputs.seq_lens, dtype=np.int32),
              np.asarray([0, *itertools.accumulate(inputs.query_lens)], dtype=np.int32), inputs.page_table]
    rows = 0 < t <= rows_up_to and max(inputs.seq_lens) > t
    if rows:
        arrays += host_decode_rows(inputs.query_lens, inputs.seq_lens, inputs.page_table)
    ids, pos, slots, logit_rows, count, lens, cu, table, *row_arrays = uploader.upload(arrays)
    meta = AttentionMetadata(
        is_decode=False, num_tokens=t, slot_mapping=slots, seq_lens=lens, query_start_loc=cu,
        page_table=table, seq_lens_host=inputs.seq_lens, query_lens_host=inputs.query_lens,
        max_query_len=max(inputs.query_lens), max_seq_len=max(inputs.seq_lens),
        decode_rows=tuple(row_arrays) if rows else None)
    return PrefillTensors(ids, pos, meta, logit_rows, count)


class PrefillRunner(GraphRunner):
    """The prefill forward behind the graph-runner interface. A key is a schedule size; its graph
    is a group: one CUDA graph per piece, sharing one capture memory, captured by running the
    compiled forward (`capture`) and replayed through the size's plan (`replay`)."""

    def __init__(self, lm: Any, kv: KVCache, device: torch.device, max_tokens: int, piecewise: bool,
                 graphs: GraphConfig | None = None, compiler: str = "eager", cache_dir: str | Path | None = None,
                 memory: GraphMemory | None = None, traced: bool | None = None,
                 max_model_len: int | None = None) -> None:
        """`traced`: trace the forward with torch.compile and split the FX graph (default: only for
        a compiler other than "eager", whose pieces are captured from the eager forward itself).
        `max_model_len`: the longest sequence, which sizes the row graphs' page tables (None: no
        row graphs, see `language/extend_row_graphs`)."""
        self.lm, self.kv, self.max_tokens = lm, kv, max_tokens
        dtype = lm.embed_tokens.weight.dtype
        # Static buffers, outside graph memory; every forward reads slices of them.
        self.input_embeds = torch.zeros(max_tokens, lm.hidden_size, dtype=dtype, device=device)
        # Token-major, so a slice of the first rows is contiguous at every size (a [3, T] slice of
        # a [3, max] buffer is contiguous only at T = max, and the tracer would see two layouts).
        self.positions = torch.zeros(max_tokens, 3, dtype=torch.int64, device=device)
        # KV slots of the rows; each step sets its padding rows (past its tokens) to the dummy slot.
        self.dummy_slot = kv.dummy_slot
        self.slots = torch.full((max_tokens,), self.dummy_slot, dtype=torch.int64, device=device)
        self.levels = int(getattr(lm, "deepstack_levels", 0))
        self.deepstack = [torch.zeros(max_tokens, lm.hidden_size, dtype=dtype, device=device)
                          for _ in range(self.levels)]
        self._written: list[tuple[int, int]] = []  # deepstack rows the last step wrote (zeroed before the next)
        graphs = graphs or GraphConfig(enabled=False)
        schedule = {min(int(s), max_tokens) for s in graphs.buckets or default_prefill_schedule(max_tokens)}
        super().__init__("prefill", device, schedule, piecewise and graphs.enabled is not False, lm.attention,
                         memory or "shared", max_graphs=None)
        self.schedule = self.sizes
        self.uploader = PackedUploader(device)  # each step's inputs, in one host-to-device copy
        # Short extends over long contexts: the whole forward as one graph, attention as decode rows.
        # A tensor-parallel shard's lookup sums the ranks' rows: it fills the fixed rows itself.
        tp = getattr(lm, "tp", None) is not None
        self.rows = RowGraphs(lm, kv, device, self.schedule, -(-(max_model_len or 0) // kv.page_size),
                              self._forward_rows, self.slots, wanted=self.cache is not None and bool(max_model_len),
                              memory=self.cache.memory if self.cache is not None else "shared",
                              fixed_rows=None if tp else (self.input_embeds, self.positions))
        self.compiled_runs = 0  # compiled forwards without a graph (above the schedule, a failed size)
        self._warm = False  # this capture_all has run a warm-up forward: later sizes capture without one
        self.warmup_retries = 0  # sizes whose capture without a warm-up failed and was redone
        self.padded_tokens = 0  # rows added to reach schedule sizes
        self.state = PiecewiseState(self.cache)
        self.backend: PiecewiseBackend | None = None
        self.compiled: Any = None
        self.compiler = compiler
        self.piecewise = piecewise
        # "eager": the eager forward's pieces captured straight from it, split where it calls
        # attention (no tracing); other compilers trace it with torch.compile.
        self.split: SplitGraphs | None = None
        if traced is None:
            traced = compiler != "eager"
        if piecewise and not traced:
            self.split = SplitGraphs(self.cache) if self.cache is not None else None
        elif piecewise:
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

    def upload(self, inputs: PrefillInputs) -> PrefillTensors:
        """A step's host inputs on the device, in one copy (views valid for this step only)."""
        return upload_inputs(inputs, self.uploader, ROW_GRAPH_MAX_TOKENS)

    def run_inputs(self, inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of a step's host inputs, and its logit rows on the device (a row graph stages them)."""
        size = self.rows.staged_size(inputs, self.lm.layers[0].self_attn.num_heads) if self.piecewise else None
        if size is not None:
            self._write_images(inputs.images)  # before the replay: the graph's staging keeps their rows
            self.padded_tokens += size - inputs.token_ids.shape[0]
            self.counts.graph_runs += 1  # a prefill served by a graph, as the pieces count theirs
            return self.rows.run_staged(size, inputs)
        ids, positions, meta, logit_rows, count = self.upload(inputs)
        return self.forward(ids, positions, inputs.images, meta, count), logit_rows

    def rows_for(self, num_tokens: int) -> int:
        """Rows the forward runs: the smallest schedule size >= num_tokens; num_tokens above the
        schedule, without compilation, or for eager pieces without graphs (padding buys nothing there)."""
        if not self.piecewise or (self.split is None and self.compiled is None):
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
        size = self.rows_for(n)
        if getattr(self.lm, "tp", None) is None:
            stage_rows(self.lm.embed_tokens.weight, token_ids, positions, meta.slot_mapping, count,
                       self.input_embeds, self.positions, self.slots, size, self.dummy_slot)
        else:  # a tensor-parallel shard holds part of the table: its lookup sums the ranks' rows
            self.lm.embed(token_ids, out=self.input_embeds[:n])
            self.positions[:n].copy_(positions)
            self.slots[:n].copy_(meta.slot_mapping)
            self.slots[n:size].fill_(self.dummy_slot)
        self._write_images(images)
        meta.split_rows = size  # decode rows split as the graph of this size would (see extend_row_graphs)
        rows = self.rows.serves(n, meta, self.lm.layers[0].self_attn.num_heads) if self.piecewise else None
        if rows is not None:
            self.padded_tokens += rows - n
            self.counts.graph_runs += 1  # a prefill served by a graph, as the pieces count theirs
            return self.rows.run_rows(rows, meta)
        with forward_context(ForwardContext(meta, self.kv.layers, self.lm.attention)):
            if not self.piecewise:
                eager = lambda: self.lm(self.input_embeds[:n], self.positions[:n].t(), self.kv.layers,  # noqa: E731
                                        meta.slot_mapping, [level[:n] for level in self.deepstack])
                return self.run(None, eager)[0]
            output, graphed = self.run(self.size_for(n), lambda: self._run_without_graphs(size))
            if graphed:
                self.padded_tokens += size - n
            return output

    def _write_images(self, images: Sequence[ImageSpan]) -> None:
        """Image rows into the fixed buffers; deepstack rows of the previous step back to zero."""
        for lo, hi in self._written:
            for level in self.deepstack:
                level[lo:hi].zero_()
        self._written = []
        for span in images:
            values, lo = span.values, span.row
            hi = lo + values.shape[0]
            if not self.levels:
                self.input_embeds[lo:hi].copy_(values)
                continue
            if values.dim() != 3 or values.shape[1] != 1 + self.levels:
                raise ValueError(f"image rows {lo}..{hi}: expected [rows, {1 + self.levels}, hidden] features "
                                 f"(main + {self.levels} deepstack levels), got {tuple(values.shape)}")
            self.input_embeds[lo:hi].copy_(values[:, 0])
            for level, buffer in enumerate(self.deepstack, start=1):
                buffer[lo:hi].copy_(values[:, level])
            self._written.append((lo, hi))

    def lookup(self, size: Any) -> Any:
        assert self.cache is not None
        if self.split is not None:
            return size if size in self.split.plans else None
        generation = self.state.generation
        live = (generation, size) not in self.cache.failed and (generation, size, 0) in self.cache
        return size if live else None

    def replay(self, size: Any) -> Any:
        """The size's pieces replayed through its plan; None if the size has no graphs (sizes are
        captured at start-up only: a forward that captures needs a warm-up forward first)."""
        if self.lookup(size) is None:
            return None
        self.counts.graph_runs += 1
        if self.split is not None:
            return self.split.replay(size)
        self.state.size = size
        return self.state.run_planned(size, lambda: self._run_compiled(size))

    def _run_without_graphs(self, size: int) -> torch.Tensor:
        self.state.size = None
        self.compiled_runs += 1
        return self._run_compiled(size)

    def _run_compiled(self, size: int) -> torch.Tensor:
        if self.compiled is None:  # the eager pieces, without graphs
            return self._forward_rows(size)
        embeds, positions = self.input_embeds[:size], self.positions[:size]
        bound = max(self.max_tokens, 3)
        torch._dynamo.mark_dynamic(embeds, 0, min=2, max=bound)
        torch._dynamo.mark_dynamic(positions, 0, min=2, max=bound)
        slots = self.slots[:size]
        torch._dynamo.mark_dynamic(slots, 0, min=2, max=bound)
        deepstack = [level[:size] for level in self.deepstack]
        for level in deepstack:
            torch._dynamo.mark_dynamic(level, 0, min=2, max=bound)
        return self.compiled(embeds, positions, self.kv.layers, slots, deepstack)

    def _forward_rows(self, size: int) -> torch.Tensor:
        """The eager forward over the first `size` rows of the fixed buffers."""
        return self.lm(self.input_embeds[:size], self.positions[:size].t(), self.kv.layers, self.slots[:size],
                       [level[:size] for level in self.deepstack])

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> None:  # type: ignore[override]
        """Compile (first call), then capture every schedule size, largest first, into one capture
        memory shared by all pieces of all sizes."""
        if not self.piecewise:
            return
        if self.cache is None and self.compiled is None:  # eager pieces without graphs: nothing to prepare
            return
        if self.cache is None:  # compiled, no graphs: trace now rather than in the first request
            start = time.perf_counter()
            self._dummy_forward(self.schedule[-1], capture=False)
            log.info("prefill compiled (%s pieces) in %.1f s; no graphs", self.state.num_pieces,
                     time.perf_counter() - start)
            return
        self.state.drop_plans()  # plans point at graphs: a new capture replaces them
        if self.split is not None:
            self.split.drop()
        self.state.memory = self.cache.memory.open()
        self._warm = False
        try:
            super().capture_all(self.startup_keys(), progress)
        finally:
            self.state.memory = None
            self.state.size = None
            self._warm = False
        self.rows.capture_all(self.rows.startup_keys(), progress)

    @property
    def lockstep(self) -> bool:
        return self._lockstep

    @lockstep.setter
    def lockstep(self, on: bool) -> None:
        GraphRunner.lockstep.fset(self, on)  # type: ignore[attr-defined]
        if getattr(self, "rows", None) is not None:
            self.rows.lockstep = on

    def startup_keys(self) -> list[Any]:
        """The schedule `capture_all` captures, largest first (none without piecewise graphs)."""
        return sorted(self.schedule, reverse=True) if self.piecewise and self.cache is not None else []

    def precompile(self, keys: Sequence[Any]) -> None:
        """A forward at each size without graphs (the first one traces), Triton kernels compiled
        in parallel rather than run (`GraphRunner.precompile`): the pieces' ops index nothing by
        kernel outputs, and the K/V they would write go to the dummy page anyway."""
        saved, self.state.cache = self.state.cache, None  # pieces run without graphs
        try:
            for size in keys:
                self._dummy_forward(size, capture=False, graphs=False)
        finally:
            self.state.cache = saved

    def capture(self, size: Any, quiet: bool = False) -> bool:
        """A warm-up forward at `size` (compiling on the first call) where one is needed, then one
        in which every piece captures its graph into the shared capture memory.

        Pieces captured from the eager forward (`split`) warm up once per `capture_all`, at its
        first (largest) size: the others are captured straight away, and only a size whose capture
        fails (a kernel first loaded inside it, say) is warmed up and captured again (a warm-up per
        size was an eager forward per size, most of the prefill graphs' start-up). In
        lockstep (tensor parallelism) every size still warms up: a rank's retry would run an eager
        forward, with its collectives, that the other ranks do not."""
        assert self.cache is not None
        memory = self.state.memory
        if self.split is not None and self._warm and not self.lockstep:
            self.state.memory = memory if memory is not None else self.cache.memory.open()
            if self._dummy_forward(size, capture=True, last_try=False):
                return True
            self.warmup_retries += 1
        self._dummy_forward(size, capture=False)
        self.state.memory = memory if memory is not None else self.cache.memory.open()
        self._dummy_forward(size, capture=True)
        self._warm = True
        return self.lookup(size) is not None

    def startup_note(self) -> str:
        if self.split is not None:
            return f" x {self.split.pieces} pieces (eager, split at attention, no tracing)"
        b = self.backend
        assert b is not None
        return (f" x {self.state.num_pieces} pieces (tracing and {self.compiler} compilation "
                f"{b.stats.compile_seconds:.1f} s, {b.stats.compilations} compiled, {b.stats.compile_cache_loads} "
                "loaded from cache)")

    def _dummy_forward(self, size: int, capture: bool, graphs: bool = True, last_try: bool = True) -> bool:
        """A forward of `size` tokens of one fresh sequence whose K/V go to the dummy page; with
        `capture` and split pieces, whether the capture succeeded (`last_try`: see `SplitGraphs`)."""
        page = self.kv.page_size
        device = self.device
        meta = AttentionMetadata(
            is_decode=False, num_tokens=size,
            slot_mapping=torch.full((size,), self.dummy_slot, dtype=torch.int64, device=device),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            page_table=torch.full((1, -(-size // page)), DUMMY_PAGE, dtype=torch.int32, device=device),
            seq_lens_host=[size], query_lens_host=[size], max_query_len=size, max_seq_len=size)
        self.slots[:size].fill_(self.dummy_slot)  # a real step's slots may still be there
        with forward_context(ForwardContext(meta, self.kv.layers, self.lm.attention)) as context:
            if self.split is not None or self.compiled is None:
                with on_capture_stream(device):
                    if capture and self.split is not None and graphs:
                        assert self.state.memory is not None
                        return self.split.capture(size, lambda: self._forward_rows(size), context,
                                                  self.state.memory, f"prefill {size} tokens", last_try)
                    self._forward_rows(size)
                return True
            self.state.size = size if self.cache is not None and graphs else None
            self.state.capturing = capture
            try:
                with on_capture_stream(device):
                    self._run_compiled(size)
            finally:
                self.state.capturing = False
        return True

    # ------------------------------------------------------------------ stats, teardown

    def detail(self) -> dict[str, Any]:
        plans = self.split.plans if self.split is not None else self.state.plans
        out: dict[str, Any] = {"compiled": self.piecewise,
                               "compiler": self.compiler if self.piecewise else None,
                               "traced": self.compiled is not None,
                               "compiled_runs": self.compiled_runs, "padded_tokens": self.padded_tokens,
                               "replay_plans": len(plans), "plan_runs": sum(plan.runs for plan in plans.values()),
                               "failed_sizes": self.failed_sizes(),
                               "row_graphs": self.rows.stats()["graphs"], **self.rows.detail()}
        if self.split is not None:
            out.update(pieces=self.split.pieces, split_points=max(0, self.split.pieces - 1),
                       warmup_retries=self.warmup_retries)
        if self.backend is not None:
            out.update(self.backend.stats.as_dict())
        return out

    def failed_sizes(self) -> list[int]:
        if self.cache is None:
            return []
        if self.split is not None:
            return sorted(key for key in self.cache.failed if isinstance(key, int))
        return sorted(key[1] for key in self.cache.failed if len(key) == 2 and key[0] == self.state.generation)

    def close(self) -> None:
        """Destroy the graphs (the shared memory itself belongs to whoever made it)."""
        self.rows.close()
        self.state.drop_plans()
        if self.split is not None:
            self.split.drop()
        super().close()
        self.state.cache = None
        self.compiled = None


def _fresh_forward(lm: Any) -> Any:
    """`lm.forward` as a function with its own code object. torch.compile keeps compiled code per
    code object: runners of different models (or two Pipelines of one model) would otherwise share
    one cache and count against one recompile limit."""
    def forward(input_embeds: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, deepstack: list[torch.Tensor]) -> torch.Tensor:
        return lm(input_embeds, positions.t(), kv_cache, slot_mapping, deepstack)  # positions [T, 3] -> [3, T]

    code = forward.__code__.replace(co_name=f"prefill_forward_{id(lm):x}")
    return types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)
