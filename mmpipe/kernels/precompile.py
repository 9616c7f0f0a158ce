"""Compiling a block's Triton kernels on a thread pool instead of one after another.

A fresh machine (an empty Triton cache) compiles each kernel specialisation the first time it is
launched, 0.3 s each on an H100 host, one after another: most of a first start-up's decode-graph
phase. `compile_in_parallel()` runs a block in which every launch through `mmpipe.kernels.launch`
does not run its kernel but submits its compilation to a thread pool (Triton's
`AsyncCompileMode`; Triton's passes and `ptxas` release the GIL, so threads do compile in
parallel), and waits for them all when the block ends; the kernels are then in Triton's caches, so
the real launches that follow (warm-ups, captures) compile nothing.

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
from typing import Iterator

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
        with mode(pool):
            launch.compile_only_thread = threading.get_ident()
            try:
                yield True
            finally:
                launch.compile_only_thread = None
        # Leaving the mode waited for every compile and put the kernels in Triton's caches.
