"""The language model's attention as one custom op, `torch.ops.mmpipe.lm_attention`.

It writes the layer's new K/V into the paged cache and computes attention into `out`, reading
metadata, cache views and the backend from the forward context. Registered with a fake
implementation, it is opaque to `torch.compile`: the piecewise prefill runner splits the model
at this op and runs it eagerly between captured pieces.
"""

from __future__ import annotations

import torch

from mmpipe.runtime.context import get_forward_context


@torch.library.custom_op("mmpipe::lm_attention", mutates_args=("out",))
def lm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    context = get_forward_context()
    k_cache, v_cache = context.kv_caches[layer]
    context.attention.forward(q, k, v, out, k_cache, v_cache, context.attn_metadata)


@lm_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None
