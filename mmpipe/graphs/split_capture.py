"""Piecewise CUDA graphs captured straight from an eager forward: no tracer, no FX graph.

A piecewise forward alternates pieces that can be captured (norms, projections, rotary + KV write,
MLP) with split points that cannot (attention, whose metadata changes every step). The forward
itself marks its split points: at each one it calls the forward context's `split_point(fn, *args)`
instead of `fn(*args)`. `SplitGraphs.capture` runs the forward once with that hook installed and a
capture open: at every split point it ends the open capture (one piece), records `fn` and its
arguments, runs `fn` eagerly, and opens the next capture; when the forward returns, the last piece
ends. The result is the same sequence that tracing with `torch.compile` and `split_module` gives
(`mmpipe.graphs.piecewise`), without the seconds dynamo spends tracing a deep model, and with
the eager forward's exact kernels, so a replay equals eager bit for bit at the same size.

A captured key is served by its `ReplayPlan`: replay piece 0, call split point 0 on the tensors it
saw at capture, replay piece 1, ... Those tensors are outputs of earlier pieces, whose addresses
every replay writes again. A split point must read only such tensors and constants (the forward
context supplies everything per step), and return nothing: its outputs are written in place.
(So there is nothing for `MMPIPE_CHECK_GRAPH_INPUTS` to compare here: a plan's tensors are fixed
when it is made; that check serves the traced path, whose plans are recorded from later forwards.)

Memory. All pieces of a key capture into one `CaptureMemory` (for the language model, the pool its
decode graphs share), largest key first. Split-point arguments and the final output are held as
weak references (`memory.weak_ref`): their blocks go back to the pool when the forward drops
them, inside the captures, so the next key's captures reuse them and graph memory stays near the
largest key's. The final output aliases graph memory: consume it before the next replay.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Hashable, Protocol

import torch

from mmpipe.graphs.cache import GraphCache
from mmpipe.graphs.capture import capture_lock, gc_paused
from mmpipe.graphs.memory import CaptureMemory, reserved_bytes, weak_ref
from mmpipe.graphs.replay_plan import ReplayPlan

log = logging.getLogger("mmpipe")


class Recorder(Protocol):
    """How a piece is recorded: CUDA stream capture on the GPU; tests on the CPU record a tape of
    ops instead (`tests/split_tape.py`)."""

    def begin(self, memory: CaptureMemory) -> Any: ...

    def end(self, handle: Any) -> Any:
        """Close the capture `begin` opened; returns a graph (`replay()`, `reset()`)."""

    def abort(self, handle: Any) -> None:
        """Close a capture that failed, discarding it."""

    def weak(self, value: Any) -> Any:
        """`value` (a tensor made inside a capture) held without owning its memory."""


class CudaRecorder:
    """Stream capture into the memory's pool, cuBLAS workspaces cleared around every piece (see
    `capture.cublas_workspaces_cleared`: a workspace made in one piece must not be used by another
    piece, or by eager code between them)."""

    def begin(self, memory: CaptureMemory) -> torch.cuda.CUDAGraph:
        torch._C._cuda_clearCublasWorkspaces()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(memory.pool_id, capture_error_mode="thread_local")
        return graph

    def end(self, handle: torch.cuda.CUDAGraph) -> torch.cuda.CUDAGraph:
        handle.capture_end()
        torch._C._cuda_clearCublasWorkspaces()
        return handle

    def abort(self, handle: torch.cuda.CUDAGraph) -> None:
        try:
            handle.capture_end()  # raises for an invalidated capture; either way the capture is over
        except Exception:
            pass
        handle.reset()

    def weak(self, value: Any) -> Any:
        return weak_ref(value)


class SplitGraphs:
    """The captured keys of one piecewise forward (a prefill runner's schedule sizes). Pieces are
    graphs of `cache`, keyed (key, piece index); `plans[key]` replays them."""

    def __init__(self, cache: GraphCache, recorder: Recorder | None = None) -> None:
        self.cache = cache
        self.recorder = recorder if recorder is not None else CudaRecorder()
        self.plans: dict[Hashable, ReplayPlan] = {}
        self.pieces = 0  # pieces per forward (split points + 1), known after the first capture

    def replay(self, key: Hashable) -> Any:
        """The final output of `key`'s plan (aliasing graph memory), or None if it has none."""
        plan = self.plans.get(key)
        return None if plan is None else plan.run()

    def capture(self, key: Hashable, forward: Callable[[], Any], context: Any, memory: CaptureMemory,
                label: str, last_try: bool = True) -> bool:
        """Run `forward` (on the capture stream, its inputs in static buffers) with its pieces
        captured into `memory` and `context.split_point` installed; False (one warning, `key`
        marked failed in the cache) if any piece cannot be captured. With `last_try=False` a
        failure only discards what was captured (the caller tries again, e.g. after a warm-up)."""
        if key in self.cache.failed:
            return False
        recorder, cache = self.recorder, self.cache
        entries: list[Any] = []
        steps: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        on_cuda = cache.device.type == "cuda"
        reserved = reserved_bytes(cache.device) if on_cuda else 0
        start = time.perf_counter()
        handle: Any = None

        def close_piece() -> None:
            nonlocal handle
            graph, handle = recorder.end(handle), None
            entry = cache.add((key, len(entries)), graph, None, memory, owns_memory=False)
            entries.append(entry)
            steps.append((cache.replay, (entry,)))

        def split_point(fn: Callable[..., Any], *args: Any) -> None:
            nonlocal handle
            close_piece()
            steps.append((fn, tuple(recorder.weak(a) for a in args)))
            fn(*args)  # on this capture's placeholder values: only so the eager code path is exercised
            handle = recorder.begin(memory)

        previous = getattr(context, "split_point", None)
        on_device = torch.cuda.device(cache.device) if on_cuda else contextlib.nullcontext()
        try:
            with capture_lock, on_device, gc_paused(), cache.memory.capturing(memory):
                context.split_point = split_point
                try:
                    handle = recorder.begin(memory)
                    output = forward()
                    final = recorder.weak(output)
                    del output  # its blocks return to the pool inside the last capture
                    close_piece()
                finally:
                    context.split_point = previous
        except Exception as exc:  # out of memory, an op that cannot be captured, ...
            if handle is not None:
                recorder.abort(handle)
            for entry in entries:
                cache.discard(entry.key)
            if not last_try:
                log.debug("%s graph capture for %s failed (%s: %s); trying again", cache.name, label,
                          type(exc).__name__, exc)
                if on_cuda:
                    torch.cuda.synchronize(cache.device)
                return False
            if cache.strict:
                raise RuntimeError(f"{cache.name} graph capture for {label} failed in lockstep with other ranks "
                                   f"({type(exc).__name__}: {exc})") from exc
            cache.mark_failed(key)
            cache.stats.capture_failures += 1
            log.warning("%s graph capture for %s failed (%s: %s); running without graphs", cache.name, label,
                        type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            if on_cuda:
                torch.cuda.synchronize(cache.device)
            return False
        if not isinstance(final, torch.Tensor):
            raise TypeError(f"a piecewise forward must return one tensor, not {type(final).__name__}")
        self.plans[key] = ReplayPlan(steps, final)
        self.pieces = len(entries)
        if on_cuda:
            cache.stats.memory_bytes += max(0, reserved_bytes(cache.device) - reserved)
        cache.stats.capture_seconds += time.perf_counter() - start
        log.debug("%s graphs captured: %s, %d pieces in %.3f s", cache.name, label, len(entries),
                  time.perf_counter() - start)
        return True

    def drop(self) -> None:
        self.plans.clear()
