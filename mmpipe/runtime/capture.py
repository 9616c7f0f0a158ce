"""Helpers for capturing CUDA graphs safely: garbage collection held off, cuBLAS workspaces
cleared around the capture, a warm-up first on the capture stream, the graph captured into a
given memory pool."""

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


_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """One side stream per device for warm-ups and captures."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


def capture(fn: Callable[[], Any], memory: GraphMemory, warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, Any,
                                                                                     CaptureMemory]:
    """Warm `fn` up eagerly, then capture it; returns (graph, its outputs, its memory)."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    mem = memory.open()
    try:
        with gc_frozen(), cublas_workspaces_cleared(), memory.capturing(mem), torch.cuda.graph(
                graph, pool=mem.pool_id, stream=stream, capture_error_mode="thread_local"):
            outputs = fn()
    except BaseException:
        graph.reset()
        memory.release(mem)
        raise
    return graph, outputs, mem
