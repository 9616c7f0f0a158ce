"""FP8 E4M3 quantization of activations in one kernel, per row (per token: each row's largest
magnitude, its scale (that / 448) and the row times the scale's reciprocal, rounded to FP8) or per
group of 128 columns of a row (`quantize_per_group`, for block-scaled FP8 weights: one scale per row and
128-column group). The PyTorch references are six kernels and two float32 copies of the
activations; these are what `mmpipe.layers.fp8.Fp8Linear` runs before an FP8 product on CUDA
whose input comes unquantized.
Both scale by the float32 reciprocal of 448 and multiply the values by the scale's float32
reciprocal (each IEEE-rounded), so they agree bit for bit, on the CPU too. Multiplying, not dividing
each value: an IEEE division is a dozen instructions on the GPU, and these kernels are as much
issue-bound as memory-bound (a norm writing FP8 rows measured markedly slower dividing;
docs/performance.md). The values differ from division's in the last float32 bit at most, which
rounding to FP8's three mantissa bits almost never sees.
The quantizer and the SiLU product hold a row up to ONE_PASS_COLUMNS wide in registers and
read it once (`row_layout`); wider rows are read twice, the second time from cache. (Weights
quantized at load per output channel go through `quantize_per_row` too.)

`Fp8Rows` carries activations already quantized, per row or per row and 128-column group: the
kernels that make a product's input (`mmpipe.kernels.fused.add_rms_norm`, `silu_mul`) can
quantize as they write it (`fp8=0` or `fp8=128`), bit for bit what `quantize_per_row` or
`quantize_per_group` of their output gives, and save the FP8 product a pass over its input.
`quantize_row` and `quantize_row_groups` are that arithmetic for a row held in registers."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.launch import launch, next_power_of_2

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = 1e-12  # an all-zero row keeps a finite scale (its values quantize to zero)
# Scales are the row maximum times the float32 reciprocal of 448 (an exact product on every device;
# PyTorch's CUDA division by a number is that product, its CPU division is not).
INV_FP8_MAX = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32))
# Rows up to this many columns are quantized from registers in one pass (see row_layout).
ONE_PASS_COLUMNS = 16384
# Group-quantized activations come with their rows padded to this: cuBLASLt's block-scaled GEMM
# takes only row counts that are multiples of 4 (on Hopper, as of torch 2.11).
GEMM_ROW_MULTIPLE = 4


class Fp8Rows(NamedTuple):
    """A 2-D activation of `count` rows quantized per row (`group` 0: scale [rows, 1]) or per row
    and `group` columns (scale [padded rows, groups] in column-major layout, values padded to
    those rows, as `quantize_per_group` gives them): x ~= values * scale, x of dtype `dtype` (the
    dtype an FP8 product of it returns)."""

    values: torch.Tensor  # [rows (padded), K] float8_e4m3fn
    scale: torch.Tensor  # float32
    dtype: torch.dtype
    group: int = 0
    count: int = -1  # rows of x (-1: all of values')

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0] if self.count < 0 else self.count, self.values.shape[1])

    @property
    def device(self) -> torch.device:
        return self.values.device


def rows_of(x: torch.Tensor, group: int = 0, row_multiple: int = 1) -> Fp8Rows:
    """A 2-D `x` quantized per row (`group` 0, `quantize_per_row`) or per row and `group` columns
    (`quantize_per_group` with `row_multiple`), as `Fp8Rows`."""
    if not group:
        values, scale = quantize_per_row(x)
        return Fp8Rows(values, scale, x.dtype)
    values, scale = quantize_per_group(x, group, row_multiple)
    return Fp8Rows(values, scale, x.dtype, group, x.shape[0])


def empty_rows(rows: int, cols: int, dtype: torch.dtype, device: torch.device, group: int = 0,
               row_multiple: int = 1) -> tuple[Fp8Rows, torch.Tensor, int]:
    """Output buffers for a kernel that quantizes as it writes: (the `Fp8Rows` it fills, its
    scale storage as the kernel indexes it, that storage's stride between groups). Per group, the
    rows past `rows` (padding to `row_multiple`) are set here: zero values, unit scales."""
    if not group:
        values = torch.empty(rows, cols, dtype=FP8, device=device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=device)
        return Fp8Rows(values, scale, dtype), scale, 0
    padded = -(-rows // row_multiple) * row_multiple
    values = torch.empty(padded, cols, dtype=FP8, device=device)
    scale = torch.empty(-(-cols // group), padded, dtype=torch.float32, device=device)
    if padded != rows:
        values[rows:].view(torch.uint8).zero_()
        scale[:, rows:].fill_(1.0)
    return Fp8Rows(values, scale.t(), dtype, group, rows), scale, padded


def quantize_per_row_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=TINY) * INV_FP8_MAX
    values = (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values [rows, K], float32 scales [rows, 1]) of a 2-D `x` with x ~= values * scales."""
    if triton is None or not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
        return quantize_per_row_reference(x)
    rows, cols = x.shape
    values = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows and cols:
        one_pass, block, warps = row_layout(cols)
        launch(_quantize_rows_kernel, (rows,), x, values, scale, cols, x.stride(0), TINY, FP8_MAX, INV_FP8_MAX,
               BLOCK=block, ONE_PASS=one_pass, num_warps=warps)
    elif rows:
        scale.fill_(TINY * INV_FP8_MAX)
    return values, scale


def row_layout(cols: int, values_per_thread: int = 16) -> tuple[bool, int, int]:
    """(one pass, BLOCK, warps) of a kernel quantizing rows of `cols` values with a scale per row,
    a program per row: up to ONE_PASS_COLUMNS the row is held in registers, `values_per_thread`
    values a thread (more where 32 warps do not reach); wider rows go in two passes of 4096
    columns. Chosen by measurement on Hopper GPUs (docs/performance.md): the quantizer is
    fastest at 16 values a thread, the SiLU product, which holds gate and up, at 8; one pass beat
    two at every width measured."""
    block = next_power_of_2(cols)
    if block <= ONE_PASS_COLUMNS:
        return True, block, min(32, max(4, block // (32 * values_per_thread)))
    return False, 4096, 8


def quantize_per_group_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x
    tiles = padded.view(rows, groups, group)
    scale = tiles.abs().amax(dim=-1).clamp(min=TINY) * INV_FP8_MAX  # [rows, groups]
    values = (tiles * (1.0 / scale[..., None])).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, -1)[:, :cols]
    return values.contiguous(), _column_major(scale)


def _column_major(scale: torch.Tensor) -> torch.Tensor:
    """[rows, groups] with the rows adjacent in memory (cuBLASLt's layout for 1x128 scales),
    allocated fresh so a single row keeps unit strides."""
    out = torch.empty(scale.shape[1], scale.shape[0], dtype=torch.float32, device=scale.device)
    out.copy_(scale.t())
    return out.t()


def quantize_per_group(x: torch.Tensor, group: int = 128, row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values [rows, K], float32 scales [rows, ceil(K / group)] in column-major layout) of a
    2-D `x`, one scale per row and group of `group` columns (the last group may be partial).
    `row_multiple`: both come with their rows padded to a multiple of it (zero values, unit
    scales), as cuBLASLt's block-scaled GEMM takes only row counts that are multiples of 4."""
    if triton is None or not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
        values, scale = quantize_per_group_reference(x, group)
        padded = -(-x.shape[0] // row_multiple) * row_multiple
        if padded != x.shape[0]:
            values = torch.cat([values, values.new_zeros(padded - x.shape[0], values.shape[1])])
            scale = _column_major(torch.cat([scale, scale.new_ones(padded - x.shape[0], scale.shape[1])]))
        return values, scale
    rows, cols = x.shape
    out, scale, padded = empty_rows(rows, cols, x.dtype, x.device, group, row_multiple)
    if rows and cols:
        # A program per row and GROUPS groups (a [GROUPS, group] tile): one program per group
        # was ~90k one-warp programs for a 1024-token prefill's down projection, one per row
        # walked its 86 groups in turn.
        tile = group_tile(cols, group)
        launch(_quantize_groups_kernel, (rows, -(-cols // (group * tile))), x, out.values, scale, padded, cols,
               x.stride(0), TINY, FP8_MAX, INV_FP8_MAX, GROUP=group, GROUPS=tile, num_warps=4)
    return out.values, out.scale


def group_tile(cols: int, group: int) -> int:
    """Groups per program of the group-quantizing kernels: 1024 columns, fewer for a short row."""
    return min(next_power_of_2(-(-cols // group)), max(1, 1024 // group))


if triton is not None:

    @triton.jit
    def reciprocal_rn(x):
        """1 / x in float32 with IEEE rounding (as PyTorch's `1.0 / x`)."""
        return tl.math.div_rn(tl.zeros_like(x) + 1.0, x)

    @triton.jit
    def quantize_row(q_ptr, s_ptr, row, cols, offs, mask, values, tiny, fp8_max, inv_fp8_max):
        """Store one row held whole in registers (`values` at columns `offs`, already rounded to
        the activations' dtype) as FP8 at q_ptr + row * cols and its scale at s_ptr + row:
        `quantize_per_row`'s arithmetic."""
        v = tl.where(mask, values.to(tl.float32), 0.0)
        scale = tl.maximum(tl.max(tl.abs(v), axis=0), tiny) * inv_fp8_max
        tl.store(s_ptr + row, scale)
        q = tl.minimum(tl.maximum(v * reciprocal_rn(scale), -fp8_max), fp8_max)
        tl.store(q_ptr + row * cols + offs, q.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def quantize_row_groups(q_ptr, s_ptr, scale_stride, row, cols, gi, values, tiny, fp8_max, inv_fp8_max,
                            GROUP: tl.constexpr):
        """Store a tile of one row (`values` [groups, GROUP], groups `gi` [groups], already
        rounded to the activations' dtype) as FP8 at q_ptr + row * cols, a scale per group at
        s_ptr + group * scale_stride + row: `quantize_per_group`'s arithmetic."""
        offs = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = offs < cols
        v = tl.where(mask, values.to(tl.float32), 0.0)
        scale = tl.maximum(tl.max(tl.abs(v), axis=1), tiny) * inv_fp8_max  # [groups]
        tl.store(s_ptr + gi * scale_stride + row, scale, mask=gi * GROUP < cols)
        q = tl.minimum(tl.maximum(v * reciprocal_rn(scale)[:, None], -fp8_max), fp8_max)
        tl.store(q_ptr + row * cols + offs, q.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, scale_stride, cols, stride_x, tiny, fp8_max, inv_fp8_max,
                                GROUP: tl.constexpr, GROUPS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        gi = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offs = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < cols, other=0.0)
        quantize_row_groups(q_ptr, s_ptr, scale_stride, row, cols, gi, x, tiny, fp8_max, inv_fp8_max, GROUP)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, cols, stride_x, tiny, fp8_max, inv_fp8_max,
                              BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        """One row per program. ONE_PASS (BLOCK covers the row): read once, held in registers. Else
        the row's largest magnitude in a first pass, then the row again (now in cache)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if ONE_PASS:
            mask = offs < cols
            x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
            quantize_row(q_ptr, s_ptr, row, cols, offs, mask, x, tiny, fp8_max, inv_fp8_max)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, cols, BLOCK):
                mask = start + offs < cols
                x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0), tiny) * inv_fp8_max
            tl.store(s_ptr + row, scale)
            inv = reciprocal_rn(scale)
            for start in range(0, cols, BLOCK):
                mask = start + offs < cols
                x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
                q = tl.minimum(tl.maximum(x * inv, -fp8_max), fp8_max)
                tl.store(q_ptr + row * cols + start + offs, q.to(tl.float8e4nv), mask=mask)
