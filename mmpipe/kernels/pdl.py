"""Programmatic dependent launch (PDL) for the short kernels of a decode step (Hopper and later).

Inside a CUDA graph a kernel still starts only after the one before it has finished: its first
programs load, its last ones drain, and between two kernels the GPU is partly idle. A decode
step on the 3B shape chains about 250 such kernels. A kernel launched with `launch_pdl=True`
may be scheduled while its predecessor's last programs still run. It begins with `pdl_enter`:
`gdc_wait()` blocks until the predecessor has completed and its writes are visible (so nothing
the kernel reads or writes can race it), then `gdc_launch_dependents()` lets the next kernel be
scheduled in turn. The overlap is only in scheduling and ramp-up; the data order is unchanged,
so results are bit-identical with PDL on or off.

The few-row products (`gemv`, 1-32 rows) take their first K step out of the loop and, with
`PREFETCH` (on unless `MMPIPE_DISABLE` names `pdl-prefetch`), load its weight tile *before* `pdl_enter`:
weights never change during a step, so that read overlaps the previous kernel's end; with it off
they call `pdl_enter` first, as every other kernel does. With the peeled kernels, prefetching
measured faster at every batch size tried, FP8 and bfloat16 (docs/performance.md). Peeling alone
once measured costly for bfloat16 at large batches, so the decode FP8 GEMM of 33-256 rows keeps
its unpeeled loop. Nothing a predecessor writes may be read before the wait
(tests/unit/test_pdl.py fails when the one-row kernel reads its input early). Releasing the
successor before waiting (a trigger-first order) was measured and rejected: it gained little at
one row and lost much at eight (docs/performance.md).

`enabled(tensor)`: PDL for launches on that tensor's device (compute capability >= 9.0, Triton
with the griddepcontrol intrinsics, `MMPIPE_DISABLE` not naming `pdl`). Kernels take a `PDL: tl.constexpr`
and call `pdl_enter(PDL)` before reading anything (the few-row products after their first
weight tile, see above); launch sites pass `PDL=on, launch_pdl=on`.
"""

from __future__ import annotations

import functools

import torch

from mmpipe import settings
from mmpipe.kernels import tl, triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # older Triton: never enabled, and the constexpr branch below is never compiled
    HAVE_GDC = False

__all__ = ["enabled", "pdl_enter"]


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    if not (t.is_cuda and HAVE_GDC and settings.current().pdl):
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


if triton is not None:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """First statement of a PDL-aware kernel: wait for the predecessor, release the successor."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

else:  # pragma: no cover - without Triton no kernel is compiled
    pdl_enter = None
