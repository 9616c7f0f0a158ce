"""The language model's attention step as one function and one custom op.

`rope_attention(qkv, cos, sin, out, layer)` rotates q and k, writes the new K/V into the paged
cache (one fused kernel) and computes attention into `out`, for the step's real tokens only
(`meta.num_tokens` rows; rows past them, the padding of a captured prefill size, are neither
written to the cache nor computed). Metadata, the cache and the backend come from the forward
context, so the call has only tensor and int arguments.

Under `torch.compile` the model calls it as the custom op `torch.ops.mmpipe.lm_attention`, which
is opaque to the compiler: the piecewise prefill runner splits the traced model at this op and
runs it eagerly, with the batch's real metadata, between captured pieces. Everywhere else
(eager forwards, decode graphs, and the split points of the piecewise runner) the plain function
is called: the custom op's dispatch costs a few hundred microseconds of host time per call.
"""

from __future__ import annotations

from typing import Any

import torch

from mmpipe.language.rope_kv import rope_qk_write_kv
from mmpipe.runtime.context import get_forward_context


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, layer: int,
                   backend: Any = None) -> None:
    """qkv [T', (H + 2*Hkv) * D] (fused projection), cos/sin [T', D], out [T', H, D] with T' >= the
    step's real token count T: rows [0, T) are computed, the rest left as they are. `backend`:
    the model's attention backend (None: the forward context's, as the custom op must)."""
    context = get_forward_context()
    meta = context.attn_metadata
    n = meta.num_tokens
    heads, dim = out.shape[1], out.shape[2]
    kv_heads = (qkv.shape[1] - heads * dim) // (2 * dim)
    k_cache, v_cache = context.kv_caches[layer]
    q, k, v = rope_qk_write_kv(qkv[:n], cos[:n], sin[:n], k_cache, v_cache, meta.slot_mapping, heads, kv_heads,
                               dim)
    (backend or context.attention).forward(q, k, v, meta, out[:n], (k_cache, v_cache))


@torch.library.custom_op("mmpipe::lm_attention", mutates_args=("out",))
def lm_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    rope_attention(qkv, cos, sin, out, layer)


@lm_attention.register_fake
def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None
