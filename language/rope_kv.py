"""The language model's rotary embedding of q and k, fused with the paged KV-cache write.

Per layer the model turns the fused qkv projection into rotated q and k and stores the new k and v
in the paged cache. Written in PyTorch that is ~14 small kernels per layer (split, rotate_half's
slices, negation and concatenation, four products, two sums, two `index_copy_`); in a decode step
near the memory-bandwidth floor each costs its minimum run time. On CUDA with Triton it is one
kernel (`language/attention/triton_rope_kv.py`); elsewhere the PyTorch reference below runs.

Both keep the exact rounding order of the unfused model code and of transformers' Qwen2.5-VL
(`apply_multimodal_rotary_pos_emb`, `apply_rotary_pos_emb` from transformers 5 on, runs in the
model dtype; it is the numerical oracle):
`x * cos + rotate_half(x) * sin` with each product rounded to the dtype, then the sum rounded.
"""

from __future__ import annotations

import torch

from mmpipe.runtime.layers import rotate_half

try:  # Triton ships with CUDA builds of PyTorch; CPU builds may lack it
    from mmpipe.language.attention.triton_rope_kv import rope_qk_write_kv_triton
except ImportError:  # pragma: no cover - depends on the install
    rope_qk_write_kv_triton = None


def rope_qk_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_qk_write_kv` in plain PyTorch, in the model's rounding order (any device)."""
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(n, num_heads, head_dim)
    k = k.view(n, num_kv_heads, head_dim)
    v = v.view(n, num_kv_heads, head_dim)
    c, s = cos[:n].unsqueeze(1), sin[:n].unsqueeze(1)
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q, k, v


def rope_qk_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2*Hkv) * D] (output of the fused qkv projection, bias included); cos, sin [T, D]
    in qkv's dtype (duplicated-halves layout). Returns q [T, H, D] rotated (contiguous), k [T, Hkv, D]
    rotated (contiguous), v [T, Hkv, D] (a view of qkv), and writes the rotated k and v of row t into
    cache slot slot_mapping[t] (flat slot = page*page_size+offset; caches are [pages, page_size, Hkv,
    D]). slot_mapping has exactly T entries (padded rows point at a reserved dummy page).

    Graph-safe: no host sync, output shapes depend only on T. One Triton kernel on CUDA, the
    reference elsewhere; both give the same bits."""
    if rope_qk_write_kv_triton is not None and qkv.is_cuda:
        return rope_qk_write_kv_triton(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                       head_dim)
    return rope_qk_write_kv_reference(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                      head_dim)
