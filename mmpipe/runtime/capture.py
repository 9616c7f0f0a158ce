"""Helpers for capturing CUDA graphs safely: garbage collection held off, a warm-up first, the
graph captured into a given memory pool."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator

import torch

from mmpipe.runtime.graph_memory import CaptureMemory, GraphMemory


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """No Python garbage collection during a capture: a collection there can free tensors whose
    memory the graph is being recorded with, or run finalizers that touch the device."""
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def capture(fn: Callable[[], Any], memory: GraphMemory, warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, Any,
                                                                                     CaptureMemory]:
    """Warm `fn` up eagerly, then capture it; returns (graph, its outputs, its memory)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    mem = memory.open()
    try:
        with gc_frozen(), memory.capturing(mem), torch.cuda.graph(graph, pool=mem.pool_id,
                                                                 capture_error_mode="thread_local"):
            outputs = fn()
    except BaseException:
        graph.reset()
        memory.release(mem)
        raise
    return graph, outputs, mem
