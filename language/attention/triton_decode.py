"""Paged decode attention in Triton, with split-KV.

One program per (sequence, KV head, split): it reads its split of the sequence's keys and values
once, through the page table, for all query heads that share the KV head (GQA), and writes a
partial result and its log-sum-exp. A second kernel combines the splits. Lengths and page tables
are read from device tensors; the grid depends only on host bounds (batch rows, heads, a bound
on the longest sequence), so one capture in a CUDA graph serves any lengths under that bound.
Rows with length 0 (padding) produce zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmpipe.language.attention.triton_common import load_paged_kv, online_softmax_step

_LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * SPLIT_TOKENS
    end = tl.minimum(start + SPLIT_TOKENS, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        k, v = load_paged_kv(k_ptr, v_ptr, table_ptr + b * stride_tb, t, tmask, kvh, d, dmask, stride_kp,
                             stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE)
        m_i, l_i, acc = online_softmax_step(q, k, v, tmask[None, :], m_i, l_i, acc, scale_log2, PRECISION)

    has_work = start < seq_len
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(has_work, m_i + tl.log2(safe_l), float("-inf"))
    o_ptrs = part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, out, mask=gmask[:, None] & dmask[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_yb, stride_yh,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < NUM_SPLITS
    dmask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
    total = tl.sum(weight, 0)
    parts = tl.load(part_out_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
    result = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_yb + h * stride_yh + d, result.to(out_ptr.dtype.element_ty), mask=dmask)


def _block_n(head_dim: int, dtype: torch.dtype) -> int:
    return 32 if (dtype == torch.float32 and head_dim > 64) else 64


def plan_splits(batch: int, kv_heads: int, max_len: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(number of splits, tokens per split): enough programs to fill the GPU a few times over,
    but no split shorter than a few hundred tokens."""
    max_len = max(1, max_len)
    want = max(1, math.ceil(4 * num_sms / max(1, batch * kv_heads)))
    splits = max(1, min(want, math.ceil(max_len / _MIN_SPLIT_TOKENS)))
    tokens = math.ceil(math.ceil(max_len / splits) / block_n) * block_n
    return math.ceil(max_len / tokens), tokens


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, scale: float, max_len: int) -> None:
    """q/out [B, Hq, D]; caches [pages, page_size, Hkv, D]; page_table [B, P] int32; seq_lens [B]
    int32; `max_len` bounds every seq_lens entry (a host int: the grid depends on it)."""
    batch, heads, head_dim = q.shape
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    block_n = _block_n(head_dim, q.dtype)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits, split_tokens = plan_splits(batch, kv_heads, max_len, block_n, num_sms)
    part_out = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    d_pad = triton.next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=block_n, SPLIT_TOKENS=split_tokens, PRECISION=precision,
        num_warps=4, num_stages=2,
    )
    _decode_reduce_kernel[(batch, heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=splits, S_PAD=max(2, triton.next_power_of_2(splits)), HEAD_DIM=head_dim, D_PAD=d_pad,
        num_warps=4,
    )
