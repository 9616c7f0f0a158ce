"""The forward context: per-step state that ops deep inside a model read without it being passed
through every module (attention metadata, the KV cache views, and the attention backend for the
custom op that `torch.compile` sees).

Ops registered with `torch.library` (the LM attention) see only tensors and ints; they look up
the rest here. This is what lets `torch.compile` trace a model forward with attention as an
opaque op, and lets graph pieces be replayed while attention runs eagerly between them. While a
piecewise forward is captured from eager code, `split_point` tells attention to leave the graph.

The context is per thread: two Pipelines stepped from two threads each see their own metadata and
KV cache. (A CUDA graph replays without Python, so only eager code and captures read it.)
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch


@dataclass
class ForwardContext:
    attn_metadata: Any
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    attention: Any = None  # the LM's backend, for the custom op (eager code uses the module's own)
    # Set while a piecewise forward is captured (`mmpipe.graphs.split_capture`): ops that must run
    # outside the graphs (attention) call `split_point(fn, *args)` instead of `fn(*args)`.
    split_point: Any = None


_local = threading.local()


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    previous = getattr(_local, "current", None)
    _local.current = context
    try:
        yield context
    finally:
        _local.current = previous


def get_forward_context() -> ForwardContext:
    current = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError("no forward context is set in this thread: model forwards must run inside "
                           "`forward_context(...)`")
    return current
