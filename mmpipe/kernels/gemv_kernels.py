"""The two Triton kernels behind `gemv`'s few-row products, and how they are launched.

A decode step's product reads every weight once, so its time is the time to read the weights.
cuBLAS tiles such skinny products for large matrices and reads the weights well below a copy's
bandwidth; two kernels do better (chosen by measurement against cuBLAS, `mmpipe bench kernels`;
see docs/performance.md):

- one row (`_row_kernel`): each program reduces a few weight rows over K with CUDA cores;
- 2-32 rows (`_swap_kernel`): a tensor-core product with the weight as the MMA's wide operand
  and the few rows as its narrow one ("swap AB"), so no MMA lane computes padding.

Matrices with few output columns give too few programs to keep every SM reading, so their K is
split (`k_splits`): each program writes a float32 slice (`PartialSums`) that the consumer adds in
a fixed order. A product is rounded to the input dtype exactly once, like cuBLAS (bias added in
float32 first); only the summation order differs. GATED forms the MLP's silu(gate) * up while the
down projection is read. SCALE reads an FP8 weight (`gemv_fp8`): per output channel, applied at
the end, or per 128 x 128 block, applied to each tile. TAIL (one row, split) has the last program
add the sums to the residual and norm the row (`partial_sums`).

Both kernels take their first K step out of the loop and, with `pdl-prefetch` on (the default),
read its weight tile before PDL's wait (see `mmpipe.kernels.pdl`). The block sizes, slice counts
and pipeline stages were chosen by sweeps on Hopper GPUs (docs/performance.md).
"""

from __future__ import annotations

import torch

from mmpipe import settings
from mmpipe.kernels import pdl, tl, triton
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2
from mmpipe.kernels.partial_sums import NormTail
from mmpipe.kernels.pdl import pdl_enter

if triton is not None:
    from mmpipe.kernels.rms_norm_row import add_rms_norm_row

__all__ = ["MIN_PROGRAMS", "SWAP_BLOCK_N", "k_slice", "k_splits", "run"]

MIN_PROGRAMS = 256  # about 2 per SM on Hopper: below this, K is split (linear_split only)
SWAP_BLOCK_N = 64  # weight rows per program of the several-row kernel (the MMA's M side)


def _scale_mode(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The kernels' SCALE: 0 none, 1 per output channel, 2 per 128 x 128 block."""
    if scale is None:
        return 0
    return 1 if scale.dim() == 1 or scale.shape[-1] == 1 else 2  # per channel: [N] or [N, 1]


# ---------------------------------------------------------------------------- launch


def k_splits(rows: int, n: int, k: int, fp8: bool = False) -> int:
    """K slices for `linear_split`: one row, a slice per ~2048 of K; several rows, enough slices
    for ~2 programs per SM, at most 4. An FP8 weight is half the bytes per slice, so twice the
    slices, at most 8. Chosen by sweeps of slice counts on Hopper GPUs (docs/performance.md)."""
    if rows == 1:
        splits = 1 << max(0, (k // 2048).bit_length() - 1)
        if fp8 and k // (2 * splits) >= 512:
            splits *= 2
        return min(8, splits)
    limit = 8 if fp8 else 4
    splits = 1
    while cdiv(n, SWAP_BLOCK_N) * splits < MIN_PROGRAMS and splits < limit and k // (2 * splits) >= 512:
        splits *= 2
    return splits


def _config(rows: int, k: int, splits: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of the one-row kernel, BLOCK_K of the other. One row of an FP8
    weight (half the bytes): longer rows per program unsplit (4 x 2048 on 4 warps, against
    bfloat16's 4 x 1024 on 8), more rows per program split (16 x 512). Chosen by sweeps on Hopper
    GPUs (docs/performance.md)."""
    if rows == 1:
        if fp8:
            block_n, block_k, warps = (4, 2048, 4) if splits == 1 else (16, 512, 4)
        else:
            block_n, block_k, warps = (4, 1024, 8) if splits == 1 else (8, 512, 4)
        return block_n, min(block_k, max(16, next_power_of_2(k))), warps
    return SWAP_BLOCK_N, min(128, max(16, next_power_of_2(k))), 4


def k_slice(rows: int, k: int, splits: int, fp8: bool = False) -> int:
    """The K columns of each of `splits` slices: a whole number of BLOCK_K."""
    block_k = _config(rows, k, splits, fp8)[1]
    return cdiv(cdiv(k, splits), block_k) * block_k


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, splits: int,
        gated: bool = False, scale: torch.Tensor | None = None, tail: NormTail | None = None) -> None:
    """Fill `out`: [rows, N] rounded (splits == 1) or [splits, rows, N] float32 partial sums.
    `scale`: an FP8 weight's float32 scales (per output channel or per 128 x 128 block). `tail`
    (one row, split): its last program also adds the sums to `tail.x` and norms the result
    (`PartialSums.add_rms_norm_in_product`)."""
    rows = x.shape[0]
    n, k = weight.shape
    has_bias = bias is not None
    on = pdl.enabled(x)
    prefetch = on and settings.current().pdl_prefetch
    b = bias if has_bias else weight  # any pointer; never read
    mode = _scale_mode(weight, scale)
    fp8 = mode != 0
    s = scale if mode else out  # any pointer; never read
    stride_s = scale.stride(0) if mode == 2 else 0
    if rows == 1:
        # 4 rows x 1024 per program unsplit; 8 x 512 when split (more, shorter programs): chosen by
        # a sweep on Hopper GPUs (docs/performance.md).
        block_n, block_k, warps = _config(rows, k, splits, fp8)
        k_split = k_slice(rows, k, splits, fp8)
        if tail is not None:
            t = (tail.x, tail.weight, tail.residual, tail.normed, tail.counter, tail.eps)
        else:
            t = (out,) * 5 + (0.0,)  # (pointers never read)
        launch(_row_kernel, (cdiv(n, block_n), splits), x, weight, b, s, out, n, k, k_split, weight.stride(0), stride_s,
               *t, HAS_BIAS=has_bias, PARTIAL=splits > 1, GATED=gated, SCALE=mode, BLOCK_N=block_n,
               BLOCK_K=block_k, TAIL=tail is not None, SPLITS=splits if tail is not None else 0,
               ROW_BLOCK=next_power_of_2(n) if tail is not None else 16,
               PDL=on, PREFETCH=prefetch, num_warps=warps, launch_pdl=on)
        return
    # Stages: 3 for unsplit products, 4 split (a sweep of stages on Hopper GPUs; docs/performance.md).
    block_m = max(8, next_power_of_2(rows))
    block_k = _config(rows, k, splits, fp8)[1]
    k_split = k_slice(rows, k, splits, fp8)
    launch(_swap_kernel, (cdiv(n, SWAP_BLOCK_N), splits), x, weight, b, s, out, rows, n, k, k_split, x.stride(0),
           weight.stride(0), stride_s, HAS_BIAS=has_bias, PARTIAL=splits > 1, GATED=gated, SCALE=mode,
           IEEE=x.dtype == torch.float32,
           BLOCK_M=block_m, BLOCK_N=SWAP_BLOCK_N, BLOCK_K=block_k, PDL=on, PREFETCH=prefetch, num_warps=4,
           num_stages=3 if splits == 1 else 4, launch_pdl=on)


# ---------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _input(ptrs, K, mask, GATED: tl.constexpr):
        """The product's input at `ptrs`; GATED: silu(gate) * up with up K columns further on,
        rounded as `fused.silu_mul` rounds (silu's output, then the product)."""
        if GATED:
            g = tl.load(ptrs, mask=mask, other=0.0)
            u = tl.load(ptrs + K, mask=mask, other=0.0)
            gf = g.to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
            return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _row_tile(acc, w, x_ptr, s_ptr, k, K, rk, stride_s, GATED: tl.constexpr, SCALE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
        """`acc` plus one BLOCK_K-column tile's products: weight tile `w` times the input at k."""
        k_mask = (k + rk) < K
        xf = _input(x_ptr + k + rk, K, k_mask, GATED).to(tl.float32)
        if SCALE == 2:  # BLOCK_N divides 128: the program's rows share their tiles' scales, so
            # scaling the input row by its 128-column tile's scale is the same product
            xf = xf * tl.load(s_ptr + (tl.program_id(0) * BLOCK_N // 128) * stride_s + (k + rk) // 128,
                              mask=k_mask, other=0.0)
        return acc + tl.sum(w.to(tl.float32) * xf[None, :], axis=1)

    @triton.jit
    def _row_kernel(x_ptr, w_ptr, b_ptr, s_ptr, out_ptr, N, K, K_SPLIT, stride_w, stride_s,
                    res_ptr, nw_ptr, res_out_ptr, normed_ptr, count_ptr, eps, HAS_BIAS: tl.constexpr,
                    PARTIAL: tl.constexpr, GATED: tl.constexpr, SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, TAIL: tl.constexpr, SPLITS: tl.constexpr, ROW_BLOCK: tl.constexpr,
                    PDL: tl.constexpr, PREFETCH: tl.constexpr):
        if not PREFETCH:
            pdl_enter(PDL)
        split = tl.program_id(1)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_mask = rn < N
        k0 = split * K_SPLIT  # < K: the launchers make no empty slice (the peeled tile assumes one)
        k_end = tl.minimum(k0 + K_SPLIT, K)
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + k0 + rk[None, :]
        # The first tile is peeled from the loop: with PREFETCH it is read before waiting on the
        # previous kernel (weights never change during a step), so its read overlaps that kernel.
        # weights are read once per step: keep them from evicting what is reused
        w = tl.load(w_ptrs, mask=n_mask[:, None] & ((k0 + rk) < K)[None, :], other=0.0, eviction_policy="evict_first")
        if PREFETCH:
            pdl_enter(PDL)
        acc = _row_tile(tl.zeros([BLOCK_N], dtype=tl.float32), w, x_ptr, s_ptr, k0, K, rk, stride_s, GATED, SCALE,
                        BLOCK_N)
        for k in range(k0 + BLOCK_K, k_end, BLOCK_K):
            w_ptrs += BLOCK_K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & ((k + rk) < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc = _row_tile(acc, w, x_ptr, s_ptr, k, K, rk, stride_s, GATED, SCALE, BLOCK_N)
        if SCALE == 1:  # an FP8 weight's per-channel scales
            acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)
        if PARTIAL:
            tl.store(out_ptr + split * N + rn, acc, mask=n_mask)
            if TAIL:  # the last program to arrive adds all the sums to the residual and norms it
                # Every thread's sums stored before the arrival releases them; the other side,
                # Triton hands the scalar atomic's result to all threads through shared memory
                # after a barrier, which orders their reads after its acquire.
                tl.debug_barrier()
                if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * SPLITS - 1:
                    offs, mask, normed = add_rms_norm_row(res_ptr, out_ptr, nw_ptr, res_out_ptr, 0, N, 0, N,
                                                          N, eps, True, SPLITS, ROW_BLOCK, True)
                    tl.store(normed_ptr + offs, normed, mask=mask)
                    tl.store(count_ptr, 0)  # the next tail counts only after PDL's wait for this kernel
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            out = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rn, out, mask=n_mask)

    @triton.jit
    def _swap_tile(acc, w, x, s_ptr, k, stride_s, SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr):
        """`acc` plus one tile's product: weight tile `w` [BLOCK_N, BLOCK_K] times input tile `x`."""
        if SCALE != 0:  # FP8 E4M3 widens exactly to the activations' dtype
            w = w.to(x.dtype)
        if SCALE == 2:  # the tile lies in one 128 x 128 block (BLOCK_N and BLOCK_K divide 128): scale its sum
            s = tl.load(s_ptr + (tl.program_id(0) * BLOCK_N // 128) * stride_s + k // 128)
            if IEEE:
                acc += tl.dot(w, tl.trans(x), input_precision="ieee") * s
            else:
                acc += tl.dot(w, tl.trans(x)) * s
        elif IEEE:  # float32 weights: no TF32 rounding
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        return acc

    @triton.jit
    def _swap_kernel(x_ptr, w_ptr, b_ptr, s_ptr, out_ptr, M, N, K, K_SPLIT, stride_x, stride_w, stride_s,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, GATED: tl.constexpr, SCALE: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, PREFETCH: tl.constexpr):
        if not PREFETCH:
            pdl_enter(PDL)
        split = tl.program_id(1)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_mask = rn < N
        m_mask = rm < M
        k0 = split * K_SPLIT
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + k0 + rk[None, :]
        x_ptrs = x_ptr + rm[:, None] * stride_x + k0 + rk[None, :]
        # The first tile is peeled: with PREFETCH its weights are read before the wait (see _row_kernel).
        w = tl.load(w_ptrs, mask=n_mask[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        if PREFETCH:
            pdl_enter(PDL)
        x = _input(x_ptrs, K, m_mask[:, None] & ((k0 + rk) < K)[None, :], GATED)
        acc = _swap_tile(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), w, x, s_ptr, k0, stride_s, SCALE, IEEE,
                         BLOCK_N)  # out^T: weight rows x input rows
        for k in range(k0 + BLOCK_K, tl.minimum(k0 + K_SPLIT, K), BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            k_mask = (k + rk) < K
            x = _input(x_ptrs, K, m_mask[:, None] & k_mask[None, :], GATED)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = _swap_tile(acc, w, x, s_ptr, k, stride_s, SCALE, IEEE, BLOCK_N)
        if SCALE == 1:
            acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
        offs = rm[None, :] * N + rn[:, None]
        if PARTIAL:
            tl.store(out_ptr + split * M * N + offs, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            out = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs, out, mask=mask)
