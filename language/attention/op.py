"""The language model's attention as one custom op, `torch.ops.mmpipe.lm_attention`.

It computes attention into `out` (the new K/V are already in the paged cache), reading metadata,
cache views and the backend from the forward context. Registered with a fake implementation, it
is opaque to `torch.compile`: the piecewise prefill runner splits the model at this op and runs
it eagerly between captured pieces. Eager forwards call the backend directly instead: the op's
dispatch costs a few hundred microseconds of host time per call, 36 times a step in a 3B model.
"""

from __future__ import annotations

import torch

from mmpipe.runtime.context import get_forward_context


@torch.library.custom_op("mmpipe::lm_attention", mutates_args=("out",))
def lm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    context = get_forward_context()
    context.attention.forward(q, k, v, context.attn_metadata, out, context.kv_caches[layer])


@lm_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None
