"""Named ranges that mark an engine step's phases in torch.profiler traces, on the host and (as
`gpu_user_annotation`) over the kernels they launch. Free when no profiler is running, so the
engine marks its phases unconditionally; `mmpipe bench caption` reads them to draw a timeline."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

PREFIX = "mmpipe."


def phase(name: str) -> ContextManager[object]:
    """A profiler range `mmpipe.<name>` while a profiler runs; otherwise nothing."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()
