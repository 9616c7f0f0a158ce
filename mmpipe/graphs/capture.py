"""Helpers for capturing CUDA graphs safely: garbage collection held off, cuBLAS workspaces
cleared around the capture, a warm-up first on the capture stream, the graph captured into a
given memory pool."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Callable, Iterator

import torch

from mmpipe.graphs.memory import CaptureMemory, GraphMemory


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No Python garbage collection during a capture: a collection there could run finalizers that
    touch the device. Nothing is collected on purpose either: these captures happen lazily while
    serving, where a full collection is a latency spike."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def cublas_workspaces_cleared() -> Iterator[None]:
    """cuBLAS keeps one workspace per (handle, stream) for the life of the process. Made during a
    capture it lives in that graph's memory; a later capture on the same stream would reuse it
    while it belongs to another graph (or, with the VMM arena, to an address range since
    unmapped). Clearing before makes the capture allocate its own; clearing after stops anyone
    else from reusing it. (PyTorch's Inductor does the same around its recordings.)"""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """Around many captures in a row (a start-up schedule): every object frozen out of the
    collector's view and collection off, and `torch.cuda.empty_cache` a no-op (code that calls it
    between captures would return the pool's freed blocks to the driver, so the next capture
    allocates afresh instead of reusing them). No collection first: it is slow once transformers
    is imported (docs/performance.md), and garbage frozen here is collected after `unfreeze`."""
    gc.freeze()
    empty_cache = torch.cuda.empty_cache
    torch.cuda.empty_cache = lambda: None
    try:
        with gc_paused():
            yield
    finally:
        torch.cuda.empty_cache = empty_cache
        gc.unfreeze()


_streams: dict[int, torch.cuda.Stream] = {}
# One capture at a time in the process: captures share the capture stream (work another thread
# launched on it would join the graph), pause garbage collection process-wide, and clear every
# cuBLAS workspace. Captures are rare (start-up, a new shape), so serialising them costs nothing.
capture_lock = threading.RLock()


def capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """One side stream per device for warm-ups and captures."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


@contextlib.contextmanager
def on_capture_stream(device: torch.device) -> Iterator[None]:
    """Run the block on the device's capture stream (a warm-up, or a forward whose pieces capture
    themselves): after the work the current stream has queued, before any it queues later, and
    finished when the block returns. On the CPU, just the block."""
    if device.type != "cuda":
        yield
        return
    stream = capture_stream(device)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)
    stream.synchronize()


def capture(fn: Callable[[], Any], memory: GraphMemory, device: torch.device, warmups: int = 1,
            shared: CaptureMemory | None = None) -> tuple[torch.cuda.CUDAGraph, Any, CaptureMemory]:
    """Warm `fn` up eagerly, then capture it on `device`; returns (graph, its outputs, its memory).
    `shared`: capture into that already open memory (several captures that must share one).

    `capture_begin`/`capture_end` are called directly rather than through `torch.cuda.graph`,
    whose entry empties the allocator's cache on every capture (a stall, and churn, each time a
    new shape appears while serving)."""
    with capture_lock, torch.cuda.device(device):
        with on_capture_stream(device):
            for _ in range(warmups):
                fn()
        stream = capture_stream(device)
        graph = torch.cuda.CUDAGraph()
        mem = shared if shared is not None else memory.open()
        try:
            with gc_paused(), cublas_workspaces_cleared(), memory.capturing(mem), torch.cuda.stream(stream):
                graph.capture_begin(mem.pool_id, capture_error_mode="thread_local")
                try:
                    outputs = fn()
                finally:
                    graph.capture_end()
        except BaseException:
            graph.reset()
            if shared is None:
                memory.release(mem)
            raise
        return graph, outputs, mem
