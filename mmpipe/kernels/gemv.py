"""Matmuls for a few rows: the decode step's projections, read at close to memory bandwidth.

This module holds the entry points and the rule of which products take mmpipe's few-row kernels
(`gemv_kernels`) rather than cuBLAS; `gemv_fp8` has the same entry points for FP8 weights, and
`partial_sums` the K-split result type. A decode step multiplies 1-32 rows by every weight matrix
once, so its time is the time to read the weights; cuBLAS's tilings of such skinny products read
them well below a copy's bandwidth, mmpipe's kernels closer to it (docs/performance.md).

Matrices with few output columns (o, down) give too few programs to keep every SM reading, so
`linear_split` splits their K and returns `PartialSums`, which the consumer adds in a fixed order
-- `add_rms_norm` does, so the split costs no extra launch and the result is deterministic.
`gated_linear_split` forms the MLP's silu(gate) * up while it reads the down projection, so the
SiLU product is not a kernel of its own; the model uses it for one row only (with several, the
computed operand stalls the tensor-core kernel's pipelined loads). Unsplit, a narrow product gives
the several-row kernel too few programs (qkv), where cuBLAS measured faster, so `linear` leaves
such products to cuBLAS.

The kernels serve rows <= `MAX_ROWS` of a CUDA tensor in float32, bfloat16 or float16 with a
row-contiguous weight, outside `torch.compile` tracing; everything else goes to `F.linear`.
`MMPIPE_DISABLE=gemv` turns them off. Within the kernels a row's result does not depend on the
other rows (tested for padded buckets), but the path depends on the row count: one row or
several, and `MAX_ROWS`. A decode batch padded to its bucket therefore computes its real rows as
the eager step of the same bucket does (what the graph tests compare), yet not always as an
eager step of the unpadded count: 1 row padded to 2, 32 or fewer padded above `MAX_ROWS`, and qkv at
several rows (cuBLAS, whose kernel choice depends on the row count).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

from mmpipe import settings
from mmpipe.kernels import triton
from mmpipe.kernels.gemv_kernels import MIN_PROGRAMS, SWAP_BLOCK_N, k_slice, k_splits, run
from mmpipe.kernels.launch import cdiv
from mmpipe.kernels.partial_sums import PartialSums

__all__ = ["MAX_ROWS", "allowed", "enabled", "gated_linear_split", "in_decode_step", "kernel_linear",
           "linear", "linear_split", "usable"]

MAX_ROWS = 32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_local = threading.local()


@contextlib.contextmanager
def allowed(on: bool) -> Iterator[None]:
    """Within this block (this thread), `usable` is False unless `on`, and `in_decode_step()` is
    `on`. The language model enters it for every forward, `on` for decode steps: a short eager
    prefill must compute what the piecewise prefill (compiled, cuBLAS) computes, bit for bit,
    since eager is every graph mode's oracle."""
    previous = getattr(_local, "on", True), getattr(_local, "decode", False)
    _local.on = _local.decode = on
    try:
        yield
    finally:
        _local.on, _local.decode = previous


def enabled() -> bool:
    return triton is not None and settings.current().gemv and getattr(_local, "on", True)


def in_decode_step() -> bool:
    """Whether this thread runs a language-model decode step (inside `allowed(True)`): where the
    decode-only FP8 GEMM (`fp8_gemm.pick`) may run. Outside any `allowed` block (the ViT): False."""
    return getattr(_local, "decode", False)


def usable(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `x @ weight.T` runs on the few-row kernels (see the module docstring); `gated`: x is
    a fused [gate, up] projection of twice the weight's width (`gated_linear_split`)."""
    return takes(x, weight, x.dtype, gated)


def takes(x: torch.Tensor, weight: torch.Tensor, weight_dtype: torch.dtype, gated: bool) -> bool:
    if torch.compiler.is_compiling():  # traced code keeps F.linear (no guard on the row count)
        return False
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES
            and weight.dtype == weight_dtype and x.stride(1) == 1 and weight.dim() == 2 and weight.stride(1) == 1
            and weight.device == x.device and weight.shape[0] > 0
            and x.shape[1] == weight.shape[1] * (2 if gated else 1) and x.shape[1] > 0 and enabled())


def bias_ok(bias: torch.Tensor | None, weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    return bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous()
                            and bias.dtype == (dtype or weight.dtype) and bias.device == weight.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), converted to `out_dtype` if given (after rounding to x's dtype,
    as `F.linear(...).to(out_dtype)` would)."""
    if (not usable(x, weight) or not bias_ok(bias, weight)
            or (x.shape[0] > 1 and cdiv(weight.shape[0], SWAP_BLOCK_N) < MIN_PROGRAMS // 2)):
        # Several rows, few output tiles and no split to spread them (qkv, 40 tiles): cuBLAS
        # measured faster there (docs/performance.md).
        out = F.linear(x, weight, bias)
        return out if out_dtype is None else out.to(out_dtype)
    return kernel_linear(x, weight, bias, out_dtype)


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`linear` on the few-row kernels whatever the shape; requires `usable(x, weight)`."""
    if not usable(x, weight) or not bias_ok(bias, weight):
        raise ValueError("kernel_linear: inputs the few-row kernels do not take (see gemv.usable; the bias "
                         "must be contiguous, of the weight's rows, dtype and device)")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    run(x, weight, bias, out, splits=1)
    return out


def linear_split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor | PartialSums:
    """F.linear(x, weight, bias), or its `PartialSums` where splitting K keeps more SMs reading."""
    if not usable(x, weight) or bias is not None:
        return linear(x, weight, bias)
    return split_product(x, weight, gated=False)


def gated_linear_split(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | PartialSums:
    """F.linear(silu(gate) * up, weight) for gate_up = [gate, up] (halves of the last dimension),
    the SiLU product formed as the weight is read, rounded as `fused.silu_mul` rounds it (so the
    same bits as the two kernels). Requires `usable(gate_up, weight, gated=True)`."""
    if not usable(gate_up, weight, gated=True):
        raise ValueError("gated_linear_split: inputs the few-row kernels do not take (see gemv.usable)")
    return split_product(gate_up, weight, gated=True)


def split_product(x: torch.Tensor, weight: torch.Tensor, gated: bool, scale: torch.Tensor | None = None,
                  defer: bool = False) -> torch.Tensor | PartialSums:
    """The product, rounded, or its `PartialSums` where `k_splits` splits K; `scale`: an FP8
    weight's (`gemv_fp8`); `defer`: a one-row FP8 product may come pending (`PartialSums`)."""
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    fp8 = scale is not None
    splits = k_splits(rows, n, k, fp8)
    splits = cdiv(k, k_slice(rows, k, splits, fp8))  # no empty slice where rounding K up to blocks ends early
    if splits == 1:
        if not gated and scale is None:
            return linear(x, weight)
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        run(x, weight, None, out, 1, gated, scale)
        return out
    sums = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    if defer and rows == 1 and fp8:  # pending: its reader may have the last program add and norm it
        # (FP8 weights only: with bfloat16 ones, where only down is split, one-row steps measured
        # slower; docs/performance.md)
        return PartialSums(sums, x.dtype,
                           lambda tail: run(x, weight, None, sums, splits, gated, scale, tail))
    run(x, weight, None, sums, splits, gated, scale)
    return PartialSums(sums, x.dtype)
