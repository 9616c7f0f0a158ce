"""Timing shared by the benchmarks: wall time with the GPU's queued work waited for on both sides,
medians of timed repeats, the sum of one call's GPU kernel times (the floor without launch gaps),
calls replayed as one CUDA graph, and the device's copy bandwidth (the memory ceiling that
bandwidth figures are set against)."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the work queued on `device` (the current GPU when None; a CPU has none)."""
    if device is None or device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[Any, float]:
    """`fn()`'s result and its wall seconds, the device synchronized before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def wall_s(fn: Callable[[], Any], device: torch.device | None = None) -> float:
    return timed(fn, device)[1]


def median(values: Sequence[float]) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def median_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def wall_ms(fn: Callable[[], Any], warmup: int = 3, reps: int = 15) -> float:
    """The median wall time of `reps` synchronized calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return median([wall_s(fn) * 1000 for _ in range(reps)])


def kernel_ms(fn: Callable[[], Any]) -> float:
    """Sum of the GPU kernel times of one call (the floor with no launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.events():
        if getattr(event.device_type, "name", "") == "CUDA":
            total_us += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
    return total_us / 1000


def graph_us_per_call(calls: list[Callable[[], Any]]) -> float:
    """Microseconds per call of `calls` replayed as one CUDA graph (no launch gaps between them,
    as in a captured decode step)."""
    def run() -> None:
        for call in calls:
            call()

    run()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()
        torch.cuda.synchronize()
        graph.capture_begin()
        run()
        graph.capture_end()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 20 / len(calls)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s): the memory ceiling."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6
