"""The forward context: per-step state that ops deep inside a model read without it being passed
through every module (attention metadata, KV cache views, the attention backend).

Ops registered with `torch.library` (the LM attention) see only tensors and ints; they look up
the rest here. This is what lets `torch.compile` trace a model forward with attention as an
opaque op, and lets graph pieces be replayed while attention runs eagerly between them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch


@dataclass
class ForwardContext:
    attn_metadata: Any
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    attention: Any  # backend with forward(layer, q, k, v, out, context)


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, context
    try:
        yield context
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: model forwards must run inside `forward_context(...)`")
    return _current
