"""The language model's per-layer ops around attention, as functions and as custom ops.

- `rope_kv_write` (`torch.ops.mmpipe.rope_kv_write`): rotates q and k and writes the new K/V into
  the paged cache at `slot_mapping` (one fused kernel). It is graph-safe (shapes depend only on the
  row count; padded rows' slots point at the dummy page), so the piecewise prefill runner keeps it
  inside its captured pieces. As a custom op that declares the cache mutation, compilers keep the
  write in place.
- `rope_attention`: both of the above for eager code, one kernel in a decode step where the backend
  fuses them (`decode_rope`).
- `attention` (`torch.ops.mmpipe.lm_attention`): attention of the new queries over the cache,
  into `out`, for the step's real tokens (`meta.num_tokens` rows; rows past them, the padding of a
  captured prefill size, are not attended). Metadata and the backend come from the forward
  context. The op is opaque to `torch.compile`: the piecewise prefill runner splits the traced
  model there and runs it eagerly, with the batch's real metadata, between captured pieces.

Eager code (eager forwards, decode graphs, and the split points of the piecewise runner) calls the
plain functions: a custom op's dispatch costs host time on every call.
"""

from __future__ import annotations

from typing import Any, Optional  # torch.library reads the annotations: Optional, not `X | None`

import torch

from mmpipe.kernels.rope_kv import rope_qk_write_kv
from mmpipe.layers.context import get_forward_context


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
              backend: Any = None) -> None:
    """q/out [T', H, D], k/v [T', Hkv, D] with T' >= the step's real token count T
    (`meta.num_tokens`): rows [0, T) of `out` are computed; rows past them are padding whose
    outputs are dropped (the CUDA backend leaves them, the reference one zeroes them). Nothing is
    sliced here: four slices would cost more host time than the Triton kernel's launch.
    `backend`: the model's attention backend (None: the forward context's, as the custom op
    must)."""
    context = get_forward_context()
    if context.split_point is not None:  # a piecewise capture: the pieces end and resume around it
        context.split_point(attend, q, k, v, out, layer)
        return
    (backend or context.attention).forward(q, k, v, context.attn_metadata, out, context.kv_caches[layer])


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   slot_mapping: torch.Tensor, out: torch.Tensor, layer: int, backend: Any, num_heads: int,
                   num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   eps: float) -> None:
    """`rope_qk_write_kv` then `attention`, into `out` [T', H, D] (eager code: decode graphs,
    eager forwards); a decode step on a backend that fuses the three (`decode_rope`, the CUDA
    one) runs them as one kernel."""
    context = get_forward_context()
    backend = backend or context.attention
    fused = getattr(backend, "decode_rope", None)
    if context.split_point is None and fused is not None and fused(
            qkv, cos, sin, slot_mapping, context.attn_metadata, out, kv_cache, num_heads, q_norm, k_norm, eps):
        return
    q, k, v = rope_qk_write_kv(qkv, cos, sin, *kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim, q_norm,
                               k_norm, eps)
    attention(q, k, v, out, layer, backend)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    """`attention` with the forward context's backend and metadata: the split point a piecewise
    prefill replays between its pieces, with each step's metadata."""
    context = get_forward_context()
    context.attention.forward(q, k, v, context.attn_metadata, out, context.kv_caches[layer])


@torch.library.custom_op("mmpipe::lm_attention", mutates_args=("out",))
def lm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    attention(q, k, v, out, layer)


@lm_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None


@torch.library.custom_op("mmpipe::rope_kv_write", mutates_args=("k_cache", "v_cache"))
def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, _ = rope_qk_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                               q_norm, k_norm, eps)
    return q, k


@rope_kv_write.register_fake
def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
      q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None, eps: float = 1e-6
      ) -> tuple[torch.Tensor, torch.Tensor]:
    n = qkv.shape[0]
    return (qkv.new_empty(n, num_heads, head_dim), qkv.new_empty(n, num_kv_heads, head_dim))
