"""Compiling a block's Triton kernels on a thread pool instead of one after another.

A fresh machine (an empty Triton cache) compiles each kernel specialisation the first time it is
launched, a large fraction of a second each, one after another: most of a first start-up's
decode-graph phase. `compile_in_parallel()` runs a block in which every launch through
`mmpipe.kernels.launch` does not run its kernel but is recorded (once per launch key); when the
block ends, the recorded
kernels' compilations go to a thread pool (Triton's `AsyncCompileMode`; Triton's passes and
`ptxas` release the GIL, so threads do compile in parallel), and the block waits for them all; the
kernels are then in Triton's caches, so the real launches that follow (warm-ups, captures)
compile nothing.

When the compilations are done, each new kernel is also loaded on the pool (its module into the
CUDA context, and its C launcher, which Triton builds with the system's C compiler the first time
a signature is launched: a fraction of a second each, over a dozen for the decode graphs, which
the first captures otherwise built one after another).

The block must be safe to run with those kernels skipped: the data they would have written stays
whatever the buffers held, so use it only on warm-up work whose results are thrown away and whose
PyTorch ops index nothing by such data (the graph runners' capture bodies: every index they use
comes from their static input buffers). Kernels launched any other way compile (in the pool) and
run as usual. Without Triton, or a Triton without `AsyncCompileMode`, the block runs normally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch

from mmpipe.kernels import triton

log = logging.getLogger("mmpipe")


def _async_compile_mode() -> type | None:
    if triton is None:
        return None
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton
        return None
    return AsyncCompileMode


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


@contextlib.contextmanager
def compile_in_parallel(workers: int | None = None) -> Iterator[bool]:
    """See the module docstring; yields whether kernels are being compiled in parallel (False:
    the block runs normally). Only launches from the calling thread are diverted."""
    from mmpipe.kernels.launch import launch

    mode = _async_compile_mode()
    if mode is None or launch.compile_only_thread is not None:
        yield False
        return
    with ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="mmpipe-triton") as pool:
        try:  # a compilation that fails is not raised here (nor left cached): its real launch raises it
            compiling = mode(pool, ignore_errors=True)
        except TypeError:  # a Triton without the option
            compiling = mode(pool)
        devices: set[int] = set()
        with compiling:
            launch.compile_only_seen.clear()
            launch.compile_only_pending = []
            launch.compile_only_thread = threading.get_ident()
            failed = False
            try:
                yield True
            except BaseException:
                failed = True
                raise
            finally:
                launches, launch.compile_only_pending = launch.compile_only_pending, []
                launch.compile_only_seen.clear()
                launch.compile_only_thread = None  # last: a block another thread starts now starts clean
                # Submitted only now, all at once: submitted as the block ran, the compiling
                # threads (Triton's front end is Python) took the GIL from the block's own Python,
                # and its walk over the start-up schedules took several times as long.
                if not failed:
                    for kernel, args, grid, kwargs, device in launches:
                        devices.add(device)
                        with torch.cuda.device(device):  # Triton compiles for the current device
                            kernel.warmup(*args, grid=grid, **kwargs)
                pending = list(compiling.future_kernels.values())  # newer Tritons clear them on leaving
        # Leaving the mode waited for every compile and put the kernels in Triton's caches.
        if len(devices) == 1:  # (launches on several devices: each kernel loads at its first launch)
            _load_in_parallel(pool, [f.kernel for f in pending if getattr(f, "kernel", None) is not None],
                              devices.pop())


def _load_in_parallel(pool: ThreadPoolExecutor, kernels: list[Any], device: int) -> None:
    """Load compiled kernels (module and launcher) on the pool's threads, on CUDA device
    `device`. A kernel that fails to load is left as it is: its first launch raises the error
    where it belongs."""
    if not kernels or not torch.cuda.is_available():
        return

    def load(kernel: Any) -> None:
        try:
            torch.cuda.set_device(device)  # Triton loads on the thread's current device
            kernel._init_handles()
        except Exception:  # noqa: BLE001 - reported by the launch that needs the kernel
            log.debug("loading a precompiled Triton kernel failed", exc_info=True)

    list(pool.map(load, kernels))
