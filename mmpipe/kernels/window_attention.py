"""Attention within short segments (the ViT's windows) in one Triton program per (segment, head).

Qwen2.5-VL's windowed blocks attend within 8x8-patch windows: 64 tokens, head dim 80.
FlashAttention tiles queries by 128 rows and pads the head dim to 96, so it computes on mostly
empty tiles there and falls far short of the memory bandwidth these layers could use. Here a
segment of at most `BLOCK` tokens is loaded whole, scores and softmax are computed in float32,
the probabilities are rounded to the input dtype before multiplying V (as FlashAttention
does), and the output is normalised in float32. Boundaries are read from a device tensor, so a
captured call replays with other boundaries, like the varlen kernel.
"""

from __future__ import annotations

import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.launch import launch, next_power_of_2

MAX_SHORT_SEGMENT = 128  # longer segments go to FlashAttention


def short_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v [N, heads, D] (any row/head strides, unit stride in D), segments of at most
    `max_len` <= MAX_SHORT_SEGMENT tokens -> [N, heads, D]. Rows in no segment are left as they are."""
    if triton is None or not q.is_cuda:
        raise RuntimeError("short_segment_attention needs Triton on a CUDA device")
    if max_len > MAX_SHORT_SEGMENT:
        raise ValueError(f"segments of up to {max_len} tokens: this kernel takes at most {MAX_SHORT_SEGMENT}")
    n, heads, dim = q.shape
    out = torch.empty((n, heads, dim), dtype=q.dtype, device=q.device) if out is None else out
    segments = cu_seqlens.shape[0] - 1
    if segments <= 0 or n == 0:
        return out
    block = max(16, next_power_of_2(max_len))
    launch(
        _short_segment_kernel, (segments, heads),
        q, k, v, out, cu_seqlens, dim ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK=block, BLOCK_D=max(16, next_power_of_2(dim)), num_warps=4 if block <= 64 else 8)
    return out


if triton is not None:

    @triton.jit
    def _short_segment_kernel(q, k, v, out, cu, scale, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        seg = tl.program_id(0)
        head = tl.program_id(1)
        start = tl.load(cu + seg)
        length = tl.load(cu + seg + 1) - start
        if length > 0:
            rows = tl.arange(0, BLOCK)
            dims = tl.arange(0, BLOCK_D)
            row_ok = rows < length
            mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
            token = (start + rows).to(tl.int64)[:, None]
            qb = tl.load(q + token * sq_t + head * sq_h + dims[None, :], mask=mask, other=0.0)
            kb = tl.load(k + token * sk_t + head * sk_h + dims[None, :], mask=mask, other=0.0)
            vb = tl.load(v + token * sv_t + head * sv_h + dims[None, :], mask=mask, other=0.0)
            scores = tl.dot(qb, tl.trans(kb)) * scale
            scores = tl.where(row_ok[None, :], scores, float("-inf"))
            probs = tl.exp(scores - tl.max(scores, 1)[:, None])
            total = tl.sum(probs, 1)
            acc = tl.dot(probs.to(vb.dtype), vb) / total[:, None]
            tl.store(out + token * so_t + head * so_h + dims[None, :], acc.to(out.dtype.element_ty), mask=mask)
