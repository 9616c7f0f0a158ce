"""Paged decode attention in Triton, with a fixed number of KV splits.

One program per (sequence, KV head, split): it reads its split of the sequence's keys and values
once, through the page table, for all query heads that share the KV head (GQA). Decode steps are
captured in CUDA graphs, one per batch-size bucket, and replayed for any sequence lengths, so
nothing about the launch may depend on lengths: the grid is (batch rows, KV heads, `num_splits`),
all host ints fixed by the bucket, and each program reads its sequence's length from the device
and takes an equal share of it (split s of n covers tokens [s*chunk, min((s+1)*chunk, len)),
chunk = cdiv(len, n) rounded up to the key block). A grid sized from a bound on the length would
have to use the longest possible length inside a graph, and at short contexts almost all of its
programs would idle; with a share of the actual length every split works whatever the length
(only lengths under n key blocks leave some splits empty).

With several splits each program writes a partial result and its log-sum-exp, and a second kernel
combines them. With one split (batches large enough to fill the GPU on their own) the one kernel
normalises and writes the output directly: no partial buffers, no second launch. Rows with length
0 (padding) produce zeros.

`paged_decode_rope` takes the qkv projection instead of q and does `rope_kv`'s work in the same
kernel (one launch fewer per layer and step): each program rotates its query heads in registers;
the split whose range holds the newest position rotates the new key, writes the new K/V to the
cache and passes a CTA barrier before its loop reads them back (no other program reads that
position). The loop is the plain kernel's. A first version substituted the new K/V inside it (a
select on every K/V tile): the tiles then went through registers instead of straight to shared
memory, the kernel needed far more registers per thread, and decode steps measured slower
(docs/performance.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmpipe.kernels import require_triton, tl, triton

require_triton("the paged decode attention kernels")

from mmpipe.kernels import pdl
from mmpipe.kernels.attention_common import load_paged_kv, online_softmax_step
from mmpipe.kernels.launch import launch, next_power_of_2
from mmpipe.kernels.pdl import pdl_enter
from mmpipe.kernels.rope_kv import check_rope_inputs, rope_heads

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 2  # aim for at least this many programs per SM (and fewer than twice as many)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    cos_ptr, sin_ptr, slots_ptr, qn_ptr, kn_ptr, eps,
    scale_log2,
    stride_qb, stride_qh, stride_cb, stride_sb,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_yb, stride_yh,
    NUM_SPLITS: tl.constexpr, DIRECT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, QK_NORM: tl.constexpr, NO_FMA: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    # This split's share of the actual length, in whole key blocks so that only the last block of
    # the sequence is partial.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    hd_mask = gmask[:, None] & dmask[None, :]
    if ROPE:  # q_ptr is the fused qkv projection: rotate q here, and write the new K/V
        cos_row = tl.load(cos_ptr + b * stride_cb + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        sin_row = tl.load(sin_ptr + b * stride_sb + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        row = q_ptr + b * stride_qb
        q = rope_heads(row + heads[:, None] * HEAD_DIM, d[None, :], dmask[None, :], gmask[:, None], cos_row,
                       sin_row, qn_ptr, eps, HEAD_DIM, QK_NORM, NO_FMA)
        # The split whose range holds the newest position writes it (padded rows: split 0, to the
        # dummy page), then a CTA barrier orders that store before the split's own reads of it;
        # no other program reads that position.
        writer = tl.where(seq_len > 1, (seq_len - 1) // tl.maximum(chunk, 1), 0)
        if split == writer:
            k_new = rope_heads(row + (HEADS + kvh) * HEAD_DIM, d[None, :], dmask[None, :],
                               tl.full([1, 1], 1, tl.int1), cos_row, sin_row, kn_ptr, eps, HEAD_DIM, QK_NORM, NO_FMA)
            v_new = tl.load(row + (HEADS + KV_HEADS + kvh) * HEAD_DIM + d[None, :], mask=dmask[None, :], other=0.0)
            slot = tl.load(slots_ptr + b).to(tl.int64)
            page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
            tl.store(k_ptr + page * stride_kp + offset * stride_ks + kvh * stride_kh + d[None, :],
                     k_new.to(k_ptr.dtype.element_ty), mask=dmask[None, :])
            tl.store(v_ptr + page * stride_vp + offset * stride_vs + kvh * stride_vh + d[None, :],
                     v_new.to(v_ptr.dtype.element_ty), mask=dmask[None, :])
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hd_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        k, v = load_paged_kv(k_ptr, v_ptr, table_ptr + b * stride_tb, t, tmask, kvh, d, dmask, stride_kp,
                             stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE)
        m_i, l_i, acc = online_softmax_step(q, k, v, tmask[None, :], m_i, l_i, acc, scale_log2, PRECISION)

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]  # zeros where the split saw no key
    if DIRECT:
        tl.store(out_ptr + b * stride_yb + heads[:, None] * stride_yh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        has_work = (start + g * 0) < seq_len  # per head row (a vector mask, as the interpreter needs)
        lse = tl.where(has_work, m_i + tl.log2(safe_l), float("-inf"))
        # An empty split writes only its -inf log-sum-exp: the reduce never reads its partial
        # output, which saves most of the partial traffic at short contexts.
        o_ptrs = part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(o_ptrs, out, mask=hd_mask & has_work[:, None])
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_yb, stride_yh,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < NUM_SPLITS
    dmask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    live = lse > float("-inf")
    top = tl.max(lse, 0)
    weight = tl.where(live, tl.exp2(lse - top), 0.0)
    total = tl.sum(weight, 0)
    parts = tl.load(part_out_ptr + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                    mask=(smask & live)[:, None] & dmask[None, :], other=0.0)
    result = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_yb + h * stride_yh + d, result.to(out_ptr.dtype.element_ty), mask=dmask)


def key_block(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per loop step of the split kernels (float32 tiles of wide heads take half as many)."""
    return 32 if (dtype == torch.float32 and head_dim > 64) else 64


def decode_num_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU (~2-4 programs per SM), at
    most 64, at least 1.

    A function of the batch bucket only, never of lengths, so a decode graph captured for a bucket
    is right for every replay. Large batches fill the GPU with one split each and skip the reduce;
    small ones split each sequence so that long contexts still use every SM. More than 64 splits
    would only make the partials and the reduce bigger (a lone sequence then gets about one program
    per SM on a Hopper GPU)."""
    rows = max(1, batch * kv_heads)
    return max(1, min(_MAX_SPLITS, math.ceil(_PROGRAMS_PER_SM * max(1, num_sms) / rows)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, scale: float, num_splits: int) -> None:
    """q/out [B, Hq, D]; caches [pages, page_size, Hkv, D]; page_table [B, P] int32; seq_lens [B]
    int32 (read on the device: any lengths, any page tables); `num_splits` >= 1 splits per
    (sequence, KV head), a host int the grid depends on (see `decode_num_splits`)."""
    _decode(q, q.shape[1], k_cache, v_cache, page_table, seq_lens, out, scale, num_splits, None)


def paged_decode_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                      out: torch.Tensor, scale: float, num_splits: int, num_heads: int,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                      no_fma: bool = True) -> None:
    """`rope_qk_write_kv` then `paged_decode`, in one kernel: qkv [B, (Hq + 2*Hkv) * D] is the
    fused projection of the step's one new token per row, cos/sin [B, D] its rotary tables,
    slot_mapping [B] its cache slots (padded rows: the dummy page). Each program rotates its query
    heads (with q_norm / k_norm normalising them first, Qwen3); the split holding the newest
    position writes the new K/V (see the module notes). seq_lens count the new token. The same
    bits as the two kernels (output and cache), except that Qwen3's head-norm statistic sums in
    another order.
    `no_fma=False`: plain products, for the Triton interpreter only (see `rope_kv`)."""
    heads, dim = out.shape[1], out.shape[2]
    if heads != num_heads:
        raise ValueError(f"out {tuple(out.shape)}: expected {num_heads} heads")
    norm = check_rope_inputs(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, k_cache.shape[2], dim, q_norm,
                             k_norm)
    _decode(qkv, heads, k_cache, v_cache, page_table, seq_lens, out, scale, num_splits,
            (cos, sin, slot_mapping, q_norm if norm else qkv, k_norm if norm else qkv, eps, norm, no_fma))


def _decode(q: torch.Tensor, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, scale: float, num_splits: int,
            rope: tuple[Any, ...] | None) -> None:
    """Both entry points' launches; `q` is [B, H, D] queries, or with `rope` the qkv rows."""
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}: need at least 1")
    batch, head_dim = q.shape[0], out.shape[2]
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    block_n = key_block(head_dim, q.dtype)
    d_pad = next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    direct = num_splits == 1
    on = pdl.enabled(q)
    if direct:  # the kernel writes `out` itself; the partial pointers are never touched
        part_out, part_lse = out, out
        part_strides = (0, 0, 0, 0, 0)
    else:
        part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                        part_lse.stride(0), part_lse.stride(1))
    if rope is None:  # the rotary arguments are never read: any pointers will do
        cos, sin, slots, q_norm, k_norm, eps, norm, no_fma = q, q, q, q, q, 0.0, False, True
        q_strides = (q.stride(0), q.stride(1), 0, 0)
    else:
        cos, sin, slots, q_norm, k_norm, eps, norm, no_fma = rope
        q_strides = (q.stride(0), head_dim, cos.stride(0), sin.stride(0))
    launch(
        _decode_split_kernel, (batch, kv_heads, num_splits),
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse, out,
        cos, sin, slots, q_norm, k_norm, eps,
        scale * _LOG2E,
        *q_strides,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        *part_strides,
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, DIRECT=direct,
        PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=block_n, PRECISION=precision, PDL=on,
        ROPE=rope is not None, HEADS=heads, KV_HEADS=kv_heads, QK_NORM=norm, NO_FMA=no_fma,
        num_warps=4, num_stages=2, launch_pdl=on,
    )
    if not direct:
        reduce_splits(part_out, part_lse, out, on)


def reduce_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, pdl_on: bool) -> None:
    """Combine split partials [rows, heads, splits, D] and their log-sum-exps [rows, heads, splits]
    (-inf: an empty split, never read) into `out` [rows, heads, D]."""
    rows, heads, num_splits, head_dim = part_out.shape
    launch(
        _decode_reduce_kernel, (rows, heads),
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, S_PAD=max(2, next_power_of_2(num_splits)), HEAD_DIM=head_dim,
        D_PAD=next_power_of_2(head_dim), PDL=pdl_on, num_warps=4, launch_pdl=pdl_on,
    )
