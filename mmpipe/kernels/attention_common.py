"""Pieces shared by the Triton attention kernels: reading a block of K/V through the page table,
and one step of the online (streaming) softmax."""

from __future__ import annotations

from mmpipe.kernels import require_triton, tl, triton

require_triton("the attention kernels")


@triton.jit
def load_paged_kv(k_ptr, v_ptr, table_row_ptr, t, tmask, kvh, d, dmask,
                  stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE: tl.constexpr):
    """K and V [BLOCK_N, D_PAD] of token positions `t` of one sequence (page table row given)."""
    page = tl.load(table_row_ptr + t // PAGE_SIZE, mask=tmask, other=0).to(tl.int64)
    slot = t % PAGE_SIZE
    mask = tmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=mask, other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                mask=mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr):
    """Fold one key block into the running max `m_i`, sum `l_i` and output `acc` (base-2 exps).
    Rows that see no key yet stay at zero weight."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
