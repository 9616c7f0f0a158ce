"""Fused elementwise kernels (Triton) for the small, many, memory-bound ops between matmuls.

In a small ViT forward most kernels are not matmuls: an RMSNorm written in PyTorch is seven
kernels, a rotary embedding of q and k fourteen. Inside a CUDA graph launches are free but each
kernel still costs its minimum run time, so the count matters. Each function here is one kernel
on CUDA and keeps the reference's rounding order exactly (float32 math, rounding to the model
dtype where PyTorch rounds); elsewhere it runs the PyTorch reference.

- `add_rms_norm(x, delta, w, eps)`: residual = x + delta (rounded), out = w * norm(residual);
  delta may be a product left as K-split partial sums (`partial_sums.PartialSums`), added up
  here, or, for one row, by the product's last program (`PartialSums.add_rms_norm_in_product`).
- `add_layer_norm(x, delta, w, b, eps)`: the same with LayerNorm (weight and bias), for the
  LayerNorm vision blocks of Qwen2-VL and Qwen3-VL.
- `rotary_qk(qkv, cos, sin, heads)`: q and k of a fused qkv rotated (rotate-half form), contiguous.
- `silu_mul(gate_up)`: silu(gate) * up for a fused [.., 2I] projection.

`add_rms_norm` and `silu_mul` take `fp8=` when their output feeds an FP8 product that quantizes
its input (`mmpipe.layers.fp8.fp8_input`): 0 for one scale per row, 128 for one per row and
128-column group (block-scaled layers; rows padded to `GEMM_ROW_MULTIPLE` for cuBLASLt). The kernel
then writes the output as FP8 with its scales (`Fp8Rows`), bit for bit `quantize_per_row` /
`quantize_per_group` of the output it would have written, instead of writing it in the model's
dtype for the quantizer to read again. With one scale per row the SiLU product reads its row once,
held in registers, up to `fp8_quant.ONE_PASS_COLUMNS` columns, else twice (`fp8_quant.row_layout`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpipe.kernels import pdl, tl, triton
from mmpipe.kernels.fp8_quant import (
    FP8_MAX,
    GEMM_ROW_MULTIPLE,
    INV_FP8_MAX,
    TINY,
    Fp8Rows,
    empty_rows,
    group_tile,
    row_layout,
    rows_of,
)
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2
from mmpipe.kernels.partial_sums import PartialSums
from mmpipe.kernels.pdl import pdl_enter

if triton is not None:
    from mmpipe.kernels.fp8_quant import quantize_row, quantize_row_groups, reciprocal_rn
    from mmpipe.kernels.rms_norm_row import add_rms_norm_row


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


# ---------------------------------------------------------------------------- references

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_qk_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = qkv.shape[0]
    q, k, v = qkv.view(n, 3, heads, -1).unbind(1)
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    qf, kf = q.float(), k.float()
    q = (qf * c + rotate_half(qf) * s).to(v.dtype)
    k = (kf * c + rotate_half(kf) * s).to(v.dtype)
    return q, k, v


# ---------------------------------------------------------------------------- public ops

def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | PartialSums | None, weight: torch.Tensor,
                 eps: float, fp8: int | None = None) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """(x + delta, rms_norm(x + delta)); with delta None, (x, rms_norm(x)). A `PartialSums` delta is
    summed in index order and rounded to x's dtype first, as `delta.total()` does. `fp8` (0, or a
    group width): the norm comes as `Fp8Rows` of its rows ([-1, hidden]; see the module docstring)."""
    cols = x.shape[-1]
    _check_group(fp8)
    if not _use_triton(x):
        if isinstance(delta, PartialSums):
            delta = delta.total()
        residual = x if delta is None else x + delta
        normed_ref = rms_norm_reference(residual, weight, eps)
        if fp8 is None:
            return residual, normed_ref
        return residual, rows_of(normed_ref.reshape(-1, cols), fp8, GEMM_ROW_MULTIPLE)
    if isinstance(delta, PartialSums) and fp8 is None:  # a pending one-row product may do it all
        done = delta.add_rms_norm_in_product(x, weight, eps)
        if done is not None:
            return done
    if fp8 is not None and (x.dtype == torch.float32 or cols < fp8):
        # A float32 row's sum of squares may be reduced in another order once the kernel also
        # writes FP8 (Triton lays the row out for the 1-byte stores): last-bit differences, so
        # float32 (tests, not a serving dtype) quantizes the norm it wrote, as before; so do rows
        # narrower than a group.
        residual, normed_alone = add_rms_norm(x, delta, weight, eps)
        return residual, rows_of(normed_alone.reshape(-1, cols), fp8, GEMM_ROW_MULTIPLE)
    x2 = x.reshape(-1, cols)
    rows = x2.shape[0]
    if fp8 is None:
        normed, scale, scale_stride = torch.empty_like(x2), x2, 0  # (scale: an unused pointer)
    else:
        out, scale, scale_stride = empty_rows(rows, cols, x.dtype, x.device, fp8, GEMM_ROW_MULTIPLE)
        normed = out.values
    residual = x2 if delta is None else torch.empty_like(x2)
    splits, split_stride = 0, 0
    if isinstance(delta, PartialSums):
        d2 = delta.sums
        if (d2.dim() != 3 or d2.shape[1:] != (rows, cols) or d2.stride(2) != 1 or d2.dtype != torch.float32
                or delta.dtype != x.dtype or d2.device != x.device):
            raise ValueError(f"add_rms_norm: partial sums {tuple(d2.shape)} {d2.dtype} (rounding to {delta.dtype}) "
                             f"do not match x {tuple(x2.shape)} {x.dtype}: need float32 [splits, {rows}, {cols}] "
                             "with unit last stride, rounding to x's dtype")
        splits, split_stride = d2.shape[0], d2.stride(0)
        stride_d = d2.stride(1)
    else:
        d2 = x2 if delta is None else delta.reshape(-1, cols)
        stride_d = d2.stride(0)
    if rows:
        launch(_add_rms_norm_kernel, (rows,), x2, d2, weight, residual, normed, scale, cols, x2.stride(0),
               stride_d, split_stride, scale_stride, eps, TINY, FP8_MAX, INV_FP8_MAX, HAS_DELTA=delta is not None,
               SPLITS=splits, QUANT=0 if fp8 is None else (2 if fp8 else 1), GROUP=fp8 or 1,
               BLOCK=next_power_of_2(cols), PDL=(on := pdl.enabled(x)), num_warps=4 if cols <= 2048 else 8,
               launch_pdl=on)
    if fp8 is not None:
        return residual.view_as(x), out
    return residual.view_as(x), normed.view_as(x)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, layer_norm(x + delta)); with delta None, (x, layer_norm(x)). The sum is rounded
    to x's dtype (as `x + delta` is), then normalised in float32 with the affine in float32 and
    one rounding (as PyTorch's LayerNorm kernel)."""
    if not _use_triton(x):
        residual = x if delta is None else x + delta
        return residual, F.layer_norm(residual, (x.shape[-1],), weight, bias, eps)
    cols = x.shape[-1]
    x2 = x.reshape(-1, cols)
    rows = x2.shape[0]
    normed = torch.empty_like(x2)
    residual = x2 if delta is None else torch.empty_like(x2)
    d2 = x2 if delta is None else delta.reshape(-1, cols)
    if rows:
        launch(_add_layer_norm_kernel, (rows,), x2, d2, weight, bias, residual, normed, cols, x2.stride(0),
               d2.stride(0), eps, HAS_DELTA=delta is not None, BLOCK=next_power_of_2(cols),
               num_warps=4 if cols <= 2048 else 8)
    return residual.view_as(x), normed.view_as(x)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k rotated ([N, heads, D], contiguous) and v (a view) from qkv [N, 3 * heads * D];
    cos/sin [N, D] float32 in the duplicated-halves layout."""
    if not _use_triton(qkv):
        return rotary_qk_reference(qkv, cos, sin, heads)
    n = qkv.shape[0]
    dim = qkv.shape[1] // (3 * heads)
    q = torch.empty(n, heads, dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    if n:
        half = dim // 2
        launch(_rotary_qk_kernel, (n,), qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), sin.stride(0),
               q.stride(0), HEADS=heads, DIM=dim, HALF=half, H_PAD=next_power_of_2(heads),
               HALF_PAD=next_power_of_2(half), num_warps=4)
    v = qkv.view(n, 3, heads, dim)[:, 2]
    return q, k, v


def silu_mul(gate_up: torch.Tensor, fp8: int | None = None) -> torch.Tensor | Fp8Rows:
    """silu(gate) * up with gate, up the two halves of the last dimension (each rounded as PyTorch
    does). `fp8` (0, or a group width): the product comes as `Fp8Rows` of its rows ([-1, I]; see
    the module docstring)."""
    _check_group(fp8)
    if not _use_triton(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return out if fp8 is None else rows_of(out.reshape(-1, out.shape[-1]), fp8, GEMM_ROW_MULTIPLE)
    cols = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * cols)
    rows = g2.shape[0]
    if fp8 is not None:
        return _silu_mul_fp8(g2, rows, cols, fp8)
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(cols))
    if rows:
        launch(_silu_mul_kernel, (rows, cdiv(cols, block)), g2, out, cols, g2.stride(0), out.stride(0),
               BLOCK=block, PDL=(on := pdl.enabled(gate_up)), num_warps=4, launch_pdl=on)
    return out.view(*gate_up.shape[:-1], cols)


def _check_group(fp8: int | None) -> None:
    if fp8 is not None and (fp8 < 0 or fp8 & (fp8 - 1)):
        raise ValueError(f"fp8={fp8}: give None, 0 (one scale per row) or a power-of-two group width")


def _silu_mul_fp8(g2: torch.Tensor, rows: int, cols: int, group: int) -> Fp8Rows:
    out, scale, scale_stride = empty_rows(rows, cols, g2.dtype, g2.device, group, GEMM_ROW_MULTIPLE)
    on = pdl.enabled(g2)
    if rows and cols and group:  # each group's scale from its own columns: one pass
        tile = group_tile(cols, group)
        launch(_silu_mul_groups_kernel, (rows, cdiv(cols, group * tile)), g2, out.values, scale, scale_stride, cols,
               g2.stride(0), TINY, FP8_MAX, INV_FP8_MAX, GROUP=group, GROUPS=tile, PDL=on, num_warps=4, launch_pdl=on)
    elif rows and cols:
        one_pass, block, warps = row_layout(cols, values_per_thread=8)  # gate and up both held
        launch(_silu_mul_quant_kernel, (rows,), g2, out.values, scale, cols, g2.stride(0), TINY, FP8_MAX,
               INV_FP8_MAX, BLOCK=block, ONE_PASS=one_pass, PDL=on, num_warps=warps, launch_pdl=on)
    elif rows and not group:
        scale.fill_(TINY * INV_FP8_MAX)
    return out


# ---------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, s_ptr, cols, stride_x, stride_d, stride_split,
                             scale_stride, eps, tiny, fp8_max, inv_fp8_max, HAS_DELTA: tl.constexpr,
                             SPLITS: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs, mask, out = add_rms_norm_row(x_ptr, d_ptr, w_ptr, res_ptr, row, cols, stride_x, stride_d,
                                           stride_split, eps, HAS_DELTA, SPLITS, BLOCK, False)
        if QUANT == 1:  # FP8 rows [rows, cols] with a scale per row, as quantize_per_row of `out`
            quantize_row(out_ptr, s_ptr, row, cols, offs, mask, out, tiny, fp8_max, inv_fp8_max)
        elif QUANT == 2:  # a scale per row and GROUP columns, as quantize_per_group of `out`
            quantize_row_groups(out_ptr, s_ptr, scale_stride, row, cols, tl.arange(0, BLOCK // GROUP),
                                tl.reshape(out, [BLOCK // GROUP, GROUP]), tiny, fp8_max, inv_fp8_max, GROUP)
        else:
            tl.store(out_ptr + row * stride_x + offs, out, mask=mask)

    @triton.jit
    def _add_layer_norm_kernel(x_ptr, d_ptr, w_ptr, b_ptr, res_ptr, out_ptr, cols, stride_x, stride_d, eps,
                               HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual, rounded as stored
            tl.store(res_ptr + row * stride_x + offs, x, mask=mask)
        h = x.to(tl.float32)
        mean = tl.sum(h, axis=0) / cols
        centred = tl.where(mask, h - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / cols
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = centred * tl.math.rsqrt(var + eps) * w + b
        tl.store(out_ptr + row * stride_x + offs, out.to(x.dtype), mask=mask)

    @triton.jit
    def _rotary_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_t, stride_c, stride_s, stride_o,
                          HEADS: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr,
                          HALF_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, H_PAD)[:, None]
        j = tl.arange(0, HALF_PAD)[None, :]
        mask = (h < HEADS) & (j < HALF)
        c1 = tl.load(cos_ptr + t * stride_c + j, mask=j < HALF, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_c + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_s + j, mask=j < HALF, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_s + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        for part in tl.static_range(2):  # 0: q, 1: k
            base = qkv_ptr + t * stride_t + part * HEADS * DIM + h * DIM
            x1 = tl.load(base + j, mask=mask, other=0.0)
            x2 = tl.load(base + HALF + j, mask=mask, other=0.0)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            o1 = (a * c1 + (-b) * s1).to(x1.dtype)
            o2 = (b * c2 + a * s2).to(x1.dtype)
            dst = (q_ptr if part == 0 else k_ptr) + t * stride_o + h * DIM
            tl.store(dst + j, o1, mask=mask)
            tl.store(dst + HALF + j, o2, mask=mask)

    @triton.jit
    def _silu_mul_kernel(g_ptr, out_ptr, cols, stride_g, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        out = _silu_mul_act(g_ptr, row, stride_g, cols, offs, mask)
        tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_act(g_ptr, row, stride_g, cols, offs, mask):
        """silu(gate) * up at columns `offs` of a row, rounded as F.silu(gate) * up rounds, in float32."""
        g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
        u = tl.load(g_ptr + row * stride_g + cols + offs, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)

    @triton.jit
    def _silu_mul_quant_kernel(g_ptr, q_ptr, s_ptr, cols, stride_g, tiny, fp8_max, inv_fp8_max, BLOCK: tl.constexpr,
                               ONE_PASS: tl.constexpr, PDL: tl.constexpr):
        """One row per program. ONE_PASS (BLOCK covers the row): the products stay in registers,
        gate and up are read once. Else the row's largest |silu(gate) * up| in a first pass, then
        the products again (their inputs now in cache) times the scale's reciprocal, as FP8."""
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if ONE_PASS:
            mask = offs < cols
            quantize_row(q_ptr, s_ptr, row, cols, offs, mask, _silu_mul_act(g_ptr, row, stride_g, cols, offs, mask),
                         tiny, fp8_max, inv_fp8_max)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, cols, BLOCK):
                mask = start + offs < cols
                amax = tl.maximum(amax, tl.abs(_silu_mul_act(g_ptr, row, stride_g, cols, start + offs, mask)))
            scale = tl.maximum(tl.max(amax, axis=0), tiny) * inv_fp8_max
            tl.store(s_ptr + row, scale)
            inv = reciprocal_rn(scale)
            for start in range(0, cols, BLOCK):
                mask = start + offs < cols
                v = _silu_mul_act(g_ptr, row, stride_g, cols, start + offs, mask)
                q = tl.minimum(tl.maximum(v * inv, -fp8_max), fp8_max)
                tl.store(q_ptr + row * cols + start + offs, q.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _silu_mul_groups_kernel(g_ptr, q_ptr, s_ptr, scale_stride, cols, stride_g, tiny, fp8_max, inv_fp8_max,
                                GROUP: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
        """GROUPS groups of one row per program, each quantized with its own scale."""
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        gi = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offs = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        v = _silu_mul_act(g_ptr, row, stride_g, cols, offs, offs < cols)
        quantize_row_groups(q_ptr, s_ptr, scale_stride, row, cols, gi, v, tiny, fp8_max, inv_fp8_max, GROUP)
