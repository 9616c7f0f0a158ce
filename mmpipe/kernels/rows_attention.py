"""Paged attention for an extend step's query tokens run as rows over a long cached context.

A chat's next turn or a repeated request leaves a prefill step of a few dozen tokens over
thousands of cached ones. As decode rows (`decode_attention`), every token is a sequence of its
own: each reads the whole cached context through its own copy of the page table, so a step of 48
tokens reads the context 48 times. Here one program takes a block of `BLOCK_ROWS` consecutive rows
and one KV head (every query head of that group, the rows and heads flattened into one tile of
about 128 query vectors), reads each key block once for all of them, and masks each row to its
own causal length. The grid is (row blocks, KV heads, splits), fixed by the number of rows, and
each program reads the lengths on the device, so a CUDA graph captured for a row count serves any
lengths, as the decode kernel does.

Rows of one block usually belong to one sequence. A block that straddles two (a step holding
several requests' tokens) is told by `seqs` (each row's sequence; padding rows < 0, after the
real ones, skipped): its program goes over its rows one at a time, each with its own page table,
which gives the same sums with less sharing. Splits divide the block's longest row into equal key
ranges; partial results and their log-sum-exps reduce as the decode kernel's do
(`decode_attention.reduce_splits`), or with one split are written normalised at once.
"""

from __future__ import annotations

import math

import torch

from mmpipe.kernels import require_triton, tl, triton

require_triton("the rows attention kernel")

from mmpipe.kernels import pdl
from mmpipe.kernels.attention_common import load_paged_kv, online_softmax_step
from mmpipe.kernels.decode_attention import key_block, reduce_splits
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2
from mmpipe.kernels.pdl import pdl_enter

_LOG2E = 1.4426950408889634
_TILE_QUERIES = 128  # query vectors (rows x heads of a group) per program
_MAX_SPLITS = 16
_PROGRAMS_PER_SM = 2


@triton.jit
def _rows_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, seqs_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    num_rows, scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_yb, stride_yh,
    NUM_SPLITS: tl.constexpr, DIRECT: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    block = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    first = block * BLOCK_ROWS

    m = tl.arange(0, BLOCK_ROWS * GROUP_PAD)  # query vector: row m // GROUP_PAD, head m % GROUP_PAD
    local = m // GROUP_PAD
    g = m % GROUP_PAD
    rows = first + local
    in_rows = rows < num_rows
    seq = tl.load(seqs_ptr + rows, mask=in_rows, other=-1)
    real = seq >= 0
    lens = tl.load(lens_ptr + rows, mask=real, other=0)
    longest = tl.max(lens, 0)
    # This split's share of the block's longest row, in whole key blocks.
    chunk = tl.cdiv(tl.cdiv(longest, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, longest)
    lead = tl.max(tl.where(real, seq, -1), 0)
    shared = lead == tl.min(tl.where(real, seq, lead), 0)  # every real row of the block: one sequence

    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    qmask = (real & (g < GROUP))[:, None] & dmask[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)

    m_i = tl.full([BLOCK_ROWS * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_ROWS * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_ROWS * GROUP_PAD, D_PAD], tl.float32)
    passes = tl.where(shared, 1, BLOCK_ROWS)
    for p in range(passes):
        # Shared: the block's first row's page table serves every row. Else row `p` alone.
        row = first + tl.where(shared, 0, p)
        mine = shared | (local == p)
        row_len = tl.max(tl.where(mine, lens, 0), 0)
        stop = tl.minimum(end, row_len)
        for n0 in range(start, stop, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            tmask = t < stop
            k, v = load_paged_kv(k_ptr, v_ptr, table_ptr + row * stride_tb, t, tmask, kvh, d, dmask, stride_kp,
                                 stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE)
            visible = mine[:, None] & tmask[None, :] & (t[None, :] < lens[:, None])
            m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION)

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]  # padding rows: zeros (they see no key)
    keep = in_rows & (g < GROUP)
    if DIRECT:
        tl.store(out_ptr + rows[:, None] * stride_yb + heads[:, None] * stride_yh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=keep[:, None] & dmask[None, :])
    else:
        has_work = keep & (start < lens)
        lse = tl.where(has_work, m_i + tl.log2(safe_l), float("-inf"))
        o_ptrs = part_out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(o_ptrs, out, mask=has_work[:, None] & dmask[None, :])
        tl.store(part_lse_ptr + rows * stride_lb + heads * stride_lh + split, lse, mask=keep)


def rows_tile(heads: int, kv_heads: int) -> tuple[int, int]:
    """(rows per program, the group padded to a power of 2): `_TILE_QUERIES` query vectors a program."""
    group_pad = next_power_of_2(max(1, heads // kv_heads))
    return max(1, _TILE_QUERIES // group_pad), group_pad


def rows_num_splits(rows: int, heads: int, kv_heads: int, num_sms: int) -> int:
    """Splits per (row block, KV head): about two programs per SM, at most `_MAX_SPLITS`. A function
    of the row count (the graph's size) only, never of lengths."""
    programs = max(1, math.ceil(rows / rows_tile(heads, kv_heads)[0]) * kv_heads)
    return max(1, min(_MAX_SPLITS, math.ceil(_PROGRAMS_PER_SM * max(1, num_sms) / programs)))


def paged_rows_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         lens: torch.Tensor, seqs: torch.Tensor, out: torch.Tensor, scale: float,
                         num_splits: int) -> None:
    """q/out [n, Hq, D] (one row per query token); caches [pages, page_size, Hkv, D]; table [n, P]
    int32 (each row's sequence's pages); lens [n] int32 (the keys each row sees: its prefix,
    itself and the rows before it in its sequence); seqs [n] int32 (each row's sequence, rows of
    one sequence consecutive; < 0: a padding row, whose output is zeros; padding rows come after
    every real row, as a step's padding does: a block takes its first row's page table)."""
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}: need at least 1")
    rows, heads, head_dim = q.shape[0], q.shape[1], out.shape[2]
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    block_rows, group_pad = rows_tile(heads, kv_heads)
    d_pad = next_power_of_2(head_dim)
    block_n = key_block(head_dim, q.dtype)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    direct = num_splits == 1
    on = pdl.enabled(q)
    if direct:
        part_out, part_lse, part_strides = out, out, (0, 0, 0, 0, 0)
    else:
        part_out = torch.empty(rows, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                        part_lse.stride(0), part_lse.stride(1))
    launch(
        _rows_split_kernel, (cdiv(rows, block_rows), kv_heads, num_splits),
        q, k_cache, v_cache, table, lens, seqs, part_out, part_lse, out,
        rows, scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0),
        *part_strides,
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, DIRECT=direct, BLOCK_ROWS=block_rows,
        PAGE_SIZE=page_size, GROUP=heads // kv_heads, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=block_n, PRECISION=precision, PDL=on,
        num_warps=8, num_stages=2, launch_pdl=on,
    )
    if not direct:
        reduce_splits(part_out, part_lse, out, on)
