"""An FP8 GEMM in Triton with per-row x per-channel or 128 x 128 block scales, and its tile
configurations, for the shapes where it beats cuBLASLt's (`torch._scaled_mm`).

For x quantized per row (xq [M, K] E4M3, sx [M, 1]) and a weight quantized per output channel
(wq [N, K], sw [N, 1]):
    y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k]  (+ bias[n]), rounded once to y's dtype.
Block-scaled (`group` 128): sx [M, ceil(K / 128)] one scale per row and 128-column group
(column-major, as `fp8_quant.quantize_per_group` gives it), sw [ceil(N / 128), >= ceil(K / 128)]
one per 128 x 128 tile; each 128-column step's product is scaled before it is accumulated.

The weight is read as it is stored ([N, K], K contiguous), which is the K-major layout Hopper's
FP8 tensor-core instructions take for both operands. `Config.split_k` > 1 leaves the product as
float32 partial sums over slices of K (scaled; `partial_sums.PartialSums`), for a consumer that
adds them.

Where it runs (`pick`, `rule`): decode steps of 33-256 rows, the rows above the few-row kernels
(`gemv.MAX_ROWS`). cuBLASLt multiplies every FP8 product with one 128 x 128-tile kernel, which
leaves most SMs idle on such products: o, qkv and down take about as long at any row count up to
512, reading the weights far below the memory's bandwidth. Here 64-row tiles, with K split into
slices where the caller adds partial sums (o and down, into `add_rms_norm`) until there are about
as many programs as SMs, take markedly less. Left to cuBLASLt: wide products (gate_up, 22016
columns: programs enough, Triton no faster above 64 rows; from 8192 columns on, so a
tensor-parallel shard of it, never swept, stays there too), prefill and ViT products (> 256 rows,
where cuBLASLt runs near the tensor cores' peak and this kernel does not beat it), large products
above 128 rows (7B down) and block-scaled products other than split ones up to 128 rows (the
per-step scaling). The rule was fitted to a sweep of row counts on the 3B and 7B shapes on Hopper
GPUs (docs/performance.md), so it applies only on Hopper, in the language model's decode steps
(`gemv.in_decode_step`: a prefill forward is compiled, and its eager form must compute the same
bits; the ViT was not swept at these sizes), unless `MMPIPE_DISABLE` names `fp8-triton-gemm`.

Accumulation: FP8 tensor cores add with fewer bits than float32; each 128-column step's sum goes
into a float32 accumulator (`_PRECISE_EVERY`), as cuBLASLt's default and DeepSeek-V3's FP8 GEMMs
do in their ways. Against accumulating a whole K loop in the tensor cores (Triton's default) that
costs a little time; promoting every 32 columns cost more and lost to cuBLASLt at 192-256 rows
(docs/performance.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mmpipe import settings
from mmpipe.kernels import gemv, pdl, tl, triton
from mmpipe.kernels.launch import cdiv, launch
from mmpipe.kernels.partial_sums import PartialSums
from mmpipe.kernels.pdl import pdl_enter

__all__ = ["Config", "fp8_gemm", "pick", "rule", "usable"]

_SCALE_BLOCK = 128
# Hopper's FP8 tensor cores add their products with fewer bits than float32. Triton's default lets
# a whole K loop accumulate so (cuBLASLt's default does not); here each 128-column step's sum is
# added to a float32 accumulator, as DeepSeek-V3's FP8 GEMMs do (0: Triton's default, for A/B).
_PRECISE_EVERY = 128
MAX_ROWS = 256  # above this, cuBLASLt
_PROGRAMS = 128  # about one program per SM (Hopper's SXM GPUs have 132)
_MIN_SLICE = 512  # columns of K per slice, at least
_WIDE_TILES = 128  # 64-column tiles (8192 columns) from which cuBLASLt's kernel has programs enough (gate_up)
_LARGE_PRODUCT = 32 << 20  # N x K above which cuBLASLt wins at 129-256 rows


class Config(NamedTuple):
    """One tile configuration: programs cover BLOCK_M x BLOCK_N of the output, walk K in BLOCK_K
    steps (128 for block-scaled weights) with `stages` loads in flight; `group_m` output row
    tiles are visited together (L2 reuse of the weight); `split_k` slices of K."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8
    split_k: int = 1

    def __str__(self) -> str:
        split = f" split {self.split_k}" if self.split_k > 1 else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.warps} s{self.stages}{split}"


def usable(values: torch.Tensor, weight: torch.Tensor) -> bool:
    """CUDA FP8 E4M3 operands, K contiguous, K a multiple of 16 (what `fp8_shape_ok` already
    asks of every FP8 layer); Triton present; not traced by torch.compile."""
    return (triton is not None and values.is_cuda and weight.is_cuda and values.dtype == torch.float8_e4m3fn
            and weight.dtype == torch.float8_e4m3fn and values.dim() == 2 and weight.dim() == 2
            and values.stride(1) == 1 and weight.stride(1) == 1 and values.shape[1] == weight.shape[1]
            and values.shape[1] % 16 == 0 and not torch.compiler.is_compiling())


def pick(rows: int, n: int, k: int, block: bool, split: bool, device: torch.device) -> Config | None:
    """The configuration to multiply `rows` x K by an N x K FP8 weight with, or None for cuBLASLt
    (see the module docstring). `block`: 128 x 128 block-scaled weights; `split`: the caller takes
    `PartialSums`."""
    if (rows > MAX_ROWS or device.type != "cuda" or triton is None or not settings.current().fp8_triton_gemm
            or not gemv.in_decode_step() or not _hopper(device)):
        return None
    return rule(rows, n, k, block, split)


def rule(rows: int, n: int, k: int, block: bool, split: bool) -> Config | None:
    """`pick`'s choice on a Hopper GPU in a decode step, fitted to a sweep of row counts on the 3B
    and 7B shapes (docs/performance.md; module docstring). Products the caller
    takes as partial sums (o, down) split K four ways up to 128 rows and two ways above while that
    keeps about one program per SM; others (qkv) stay whole on 64 x 64 tiles. The choice depends
    on the row count, so an eager decode step and the graph of its (padded) bucket compute the
    same bits only where both fall on the same side of its bounds (64, 128 and, block-scaled, 128
    rows), as the default decode buckets (48, 64, 80, ... 128, 144, ...) do; as with `gemv`'s
    kernels, custom buckets may make a padded row differ in its last bits."""
    if not 0 < rows <= MAX_ROWS or cdiv(n, 64) >= _WIDE_TILES:  # gate_up (and its shards): cuBLASLt
        return None
    if block:  # whole products lose to cuBLASLt (a scale per tile and step), split ones gain to 128 rows
        if not split or rows > 128:
            return None
        return Config(64, 64 if rows <= 64 else 128, 128, 4, 4, 1, _splits(4, k))
    if not split:
        if rows > 128 and cdiv(rows, 64) * cdiv(n, 64) >= 2 * _WIDE_TILES:  # 7B qkv at 256 rows
            return None
        return Config(64, 64, 256, 4, 3, 1) if rows <= 64 else Config(64, 64, 128, 4, 4, 1)
    if rows <= 64:
        return Config(64, 64 if n <= 2048 else 128, 128, 4, 4, 1, _splits(4, k))
    if rows <= 128:
        return Config(64, 128, 128, 4, 4, 1, _splits(4, k))
    if n * k >= _LARGE_PRODUCT:  # compute-bound enough for cuBLASLt's larger tiles (7B down)
        return None
    tiles = cdiv(rows, 64) * cdiv(n, 128)
    return Config(64, 128, 128, 4, 4, 1, _splits(2 if tiles * 2 <= _PROGRAMS + 32 else 1, k))


def _splits(want: int, k: int) -> int:
    """`want` K slices, fewer where a slice would be shorter than `_MIN_SLICE` columns."""
    splits = 1
    while splits < want and k // (2 * splits) >= _MIN_SLICE:
        splits *= 2
    return splits


@functools.lru_cache(maxsize=None)
def _hopper_index(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _hopper(device: torch.device) -> bool:
    return _hopper_index(device.index if device.index is not None else torch.cuda.current_device())


def fp8_gemm(values: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             config: Config, out_dtype: torch.dtype, bias: torch.Tensor | None = None, group: int = 0,
             rows: int | None = None) -> torch.Tensor | PartialSums:
    """The scaled product of `values` [>= rows, K] and `weight` [N, K] (see the module docstring),
    [rows, N] of `out_dtype`, or `PartialSums` of it when `config.split_k` > 1 (no bias then).
    `rows`: how many rows of `values` to multiply (group-quantized rows come padded)."""
    if not usable(values, weight):
        raise ValueError("fp8_gemm: operands it does not take (see fp8_gemm.usable)")
    m = values.shape[0] if rows is None else rows
    n, k = weight.shape
    if group:  # per row and group: [>= rows, groups] with the rows adjacent; per 128 x 128 weight tile
        ok = (scale.dim() == 2 and scale.shape[0] >= m and scale.shape[1] >= cdiv(k, group) and scale.stride(0) == 1
              and weight_scale.dim() == 2 and weight_scale.shape[0] == cdiv(n, group)
              and weight_scale.shape[1] >= cdiv(k, group) and weight_scale.stride(1) == 1)
    else:  # per row [rows, 1] and per output channel [N] or [N, 1]
        ok = (scale.shape[0] >= m and scale.numel() == scale.shape[0] and weight_scale.numel() == n
              and weight_scale.is_contiguous())
    if not ok or scale.dtype != torch.float32 or weight_scale.dtype != torch.float32 or m > values.shape[0]:
        raise ValueError(f"fp8_gemm: float32 scales of shapes {tuple(scale.shape)} and {tuple(weight_scale.shape)} "
                         f"do not fit {m} rows x {tuple(weight.shape)} {'per group' if group else 'per row'}")
    if group and (group != _SCALE_BLOCK or config.block_k != _SCALE_BLOCK):
        raise ValueError(f"fp8_gemm: block scales need group {_SCALE_BLOCK} and a BLOCK_K of {_SCALE_BLOCK}")
    if config.split_k > 1 and bias is not None:
        raise ValueError("fp8_gemm: a K-split product leaves its bias to the consumer; give none")
    splits = config.split_k
    k_split = cdiv(cdiv(k, splits), config.block_k) * config.block_k
    splits = cdiv(k, k_split)  # no empty slice
    if splits > 1:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=values.device)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=values.device)
    if m == 0:
        return PartialSums(out, out_dtype) if splits > 1 else out
    # per row: scale [M, 1] (stride between rows); per group: [rows, groups] column-major (stride between groups)
    stride_sa = scale.stride(1) if group else scale.stride(0)
    stride_sb = weight_scale.stride(0) if group else 0
    on = pdl.enabled(values)
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n), splits)
    launch(_fp8_gemm_kernel, grid, values, weight, scale, weight_scale, bias if bias is not None else out, out,
           m, n, k, k_split, values.stride(0), weight.stride(0), stride_sa, stride_sb,
           SCALE=2 if group else 1, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
           EVEN_K=k % k_split == 0 and k_split % config.block_k == 0,
           BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m, PRECISE_EVERY=_PRECISE_EVERY,
           PDL=on,
           num_warps=config.warps, num_stages=config.stages, launch_pdl=on)
    return PartialSums(out, out_dtype) if splits > 1 else out


if triton is not None:

    @triton.jit
    def _fp8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, K, K_SPLIT, stride_a, stride_b,
                         stride_sa, stride_sb, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                         EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PRECISE_EVERY: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        # GROUP_M row tiles take the column tiles in turn, so a weight tile is read from L2 by them
        per_group = GROUP_M * grid_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows and columns past the end read row 0's data again (no load masks); their results are not stored
        am = tl.where(rm < M, rm, 0)
        bn = tl.where(rn < N, rn, 0)
        rk = tl.arange(0, BLOCK_K)
        k0 = split * K_SPLIT
        a_ptrs = a_ptr + am[:, None].to(tl.int64) * stride_a + (k0 + rk)[None, :]
        b_ptrs = b_ptr + bn[:, None].to(tl.int64) * stride_b + (k0 + rk)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, tl.minimum(k0 + K_SPLIT, K), BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs, eviction_policy="evict_first")
            else:
                k_mask = (k + rk) < K
                a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            if SCALE == 2:  # BLOCK_K == 128: this step lies in one column group and one weight tile column
                sa = tl.load(sa_ptr + (k // BLOCK_K) * stride_sa + am)
                sb = tl.load(sb_ptr + (bn // BLOCK_K) * stride_sb + k // BLOCK_K)
                acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]  # a fresh sum per step
            elif PRECISE_EVERY > 0:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PRECISE_EVERY)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if SCALE == 1:
            sa = tl.load(sa_ptr + am * stride_sa)
            sb = tl.load(sb_ptr + bn)
            acc = acc * sa[:, None] * sb[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        offs = rm[:, None].to(tl.int64) * N + rn[None, :]
        if PARTIAL:
            tl.store(c_ptr + split.to(tl.int64) * M * N + offs, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + bn).to(tl.float32)[None, :]
            tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
