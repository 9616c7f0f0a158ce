"""Extend (prefill) attention over the paged KV cache in Triton.

Query tokens of several sequences attend to their sequence's cached prefix and causally to each
other: query i of a sequence with `prefix` cached tokens sees keys 0 .. prefix + i. The new
tokens' K/V are written to the cache first, so one loop over the sequence's pages covers both
parts. One program per (query block, sequence, query head).
"""

from __future__ import annotations

import torch

from mmpipe.kernels import require_triton, tl, triton

require_triton("the paged extend attention kernel")

from mmpipe.kernels.attention_common import load_paged_kv, online_softmax_step
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, qstart_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_yt, stride_yh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_tb,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_begin = tl.load(qstart_ptr + b)
    q_len = tl.load(qstart_ptr + b + 1) - q_begin
    if qb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(lens_ptr + b)
    prefix = seq_len - q_len
    kvh = h // GROUP

    i = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    imask = i < q_len
    dmask = d < HEAD_DIM
    rows = (q_begin + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=imask[:, None] & dmask[None, :], other=0.0)
    q_pos = prefix + i  # absolute position of each query

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    last = tl.minimum(seq_len, prefix + (qb + 1) * BLOCK_M)  # keys past the block's last query are masked
    for n0 in range(0, last, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < last
        k, v = load_paged_kv(k_ptr, v_ptr, table_ptr + b * stride_tb, t, tmask, kvh, d, dmask, stride_kp,
                             stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE)
        visible = (t[None, :] <= q_pos[:, None]) & tmask[None, :]
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_yt + h * stride_yh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=imask[:, None] & dmask[None, :])


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor, scale: float,
                 max_query_len: int) -> None:
    """q/out [T, Hq, D] (sequences concatenated); caches [pages, page_size, Hkv, D]; seq_lens [B]
    (cached prefix + new tokens); query_start_loc [B+1]."""
    tokens, heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    fp32 = q.dtype == torch.float32
    block_m, block_n = (32, 32) if fp32 else (64, 64)
    grid = (cdiv(max(1, max_query_len), block_m), batch, heads)
    launch(
        _extend_kernel, grid,
        q, out, k_cache, v_cache, page_table, seq_lens, query_start_loc,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        PAGE_SIZE=page_size, GROUP=heads // kv_heads, HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if fp32 else "tf32",
        num_warps=4, num_stages=2,
    )
