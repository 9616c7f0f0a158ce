"""Matmuls for a few rows: the decode step's projections, read at close to memory bandwidth.

A decode step multiplies 1-32 rows by every weight matrix once, so its time is the time to read
the weights. cuBLAS tiles such skinny products for large matrices: on an H100 (3B shape, bf16,
weights cycled so they come from memory, back to back in a CUDA graph) it reads the o and qkv
projections at 1.3-1.6 TB/s and the down projection at 2.1-2.2 TB/s, against 3.0 TB/s for a copy.
Two Triton kernels do better (`mmpipe bench kernels`, docs/bench/kernels_h100.json: µs at
1 / 8 / 32 rows, cuBLAS in brackets):

- one row (`_row_kernel`): each program reduces a few weight rows over K with CUDA cores
  (qkv 5.56 [6.88], o 4.79 [6.29], gate_up 31.2 [35.2], down 16.9 [20.3], LM head 199 [217]);
- 2-32 rows (`_swap_kernel`): a tensor-core product with the weight as the MMA's wide operand
  and the few rows as its narrow one ("swap AB"), so no MMA lane computes padding
  (o 5.1 / 5.2 [6.3 / 6.4], gate_up 33.2 / 34.2 [35.8 / 35.4], down 17.9 / 18.4 [20.7 / 21.5]).
  Unsplit, a narrow product gives it too few programs: qkv (40 tiles) took 8.2 us at 8 rows
  against cuBLAS's 6.9, so `linear` leaves such products to cuBLAS.

Matrices with few output columns (o, down: 2048 on the 3B shape) give too few programs to keep
every SM reading, so their K is split: `linear_split` returns the `PartialSums` (float32, one
slice per split), and the consumer adds them in a fixed order -- `add_rms_norm` does, so the
split costs no extra launch and the result is deterministic. A product is rounded to the input
dtype exactly once, like cuBLAS (bias added in float32 first); only the summation order differs.
`gated_linear_split` forms the MLP's silu(gate) * up while it reads the down projection, so the
SiLU product is not a kernel of its own; the model uses it for one row only (with several, the
computed operand stalls the tensor-core kernel's pipelined loads: +0.8 ms per step at batch 32).

Both kernels take their first K step out of the loop and, with `pdl-prefetch` on (the
default), read its weight tile before PDL's wait (see `mmpipe.kernels.pdl`).

A one-row split product of an FP8 weight (o and down at batch 1) comes *pending* where the model
asks (`defer=True`; `PartialSums`): not launched until read. Its reader, the residual add +
RMSNorm after it, launches it with that work in the product's last program
(`add_rms_norm_in_product`): each program stores its slice and counts its arrival on its
stream's counter, and the last to arrive adds the slices to the residual and norms the row (the
norm kernel's code, `rms_norm_row`), then resets the counter. One kernel fewer per add: 72 per
step on the 3B shape, batch 1 1.67 -> 1.60 ms/step on an H200 (docs/bench/norm_tail_h200.md).
Where it measured slower it is not used: rows wider than 2048 (the 7B shape, 7%), and bfloat16
weights, where only down splits (1%). `MMPIPE_DISABLE=decode-norm-fusion` keeps the norm kernel; the
bits are the same either way.

The kernels serve rows <= `MAX_ROWS` of a CUDA tensor in float32, bfloat16 or float16 with a
row-contiguous weight, outside `torch.compile` tracing; everything else goes to `F.linear`.
`MMPIPE_DISABLE=gemv` turns them off. Within the kernels a row's result does not depend on the other
rows (tested for padded buckets), but the path depends on the row count: one row or several,
and `MAX_ROWS`. A decode batch padded to its bucket therefore computes its real rows as the
eager step of the same bucket does (what the graph tests compare), yet not always as an eager
step of the unpadded count: 1 row padded to 2, 32 or fewer padded above `MAX_ROWS`, and qkv at
several rows (cuBLAS, whose kernel choice depends on the row count).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F

from mmpipe import settings
from mmpipe.kernels import pdl, tl, triton
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2
from mmpipe.kernels.pdl import pdl_enter

if triton is not None:
    from mmpipe.kernels.rms_norm_row import add_rms_norm_row

__all__ = ["MAX_ROWS", "PartialSums", "fp8_gated_linear_split", "fp8_linear", "fp8_linear_split", "fp8_usable",
           "gated_linear_split", "kernel_linear", "linear", "linear_split", "usable"]

MAX_ROWS = 32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_PROGRAMS = 256  # ~2 per SM on an H100: below this, K is split (linear_split only)
_SWAP_BLOCK_N = 64  # weight rows per program of the several-row kernel (the MMA's M side)


class PartialSums:
    """A product left as `sums.shape[0]` float32 partial sums over slices of K; its value is their
    sum in index order, rounded to `dtype` (`total()`).

    A one-row FP8 product asked for with `defer=True` comes *pending*: launched when first read
    (`sums`), unless the reader is the residual add + RMSNorm after it (`fused.add_rms_norm`), which
    launches it through `add_rms_norm_in_product` with that add and norm done by the product's last
    program: one kernel fewer per add (see the module docstring). The launch goes to the stream
    current when it is read, with the input as it is then: the model hands the product straight to
    its add."""

    __slots__ = ("_pending", "_sums", "dtype")

    def __init__(self, sums: torch.Tensor, dtype: torch.dtype,
                 pending: Callable[[_NormTail | None], None] | None = None) -> None:
        self._sums = sums  # [splits, rows, out_features] float32
        self.dtype = dtype
        self._pending = pending  # launches the product into `_sums` (with the tail, if given)

    @property
    def sums(self) -> torch.Tensor:
        if self._pending is not None:
            self._pending(None)
            self._pending = None  # (after the launch: one that raised leaves it pending, not unwritten)
        return self._sums

    def total(self) -> torch.Tensor:
        acc = self.sums[0]
        for part in self.sums[1:]:  # the order the kernels' consumers add them in
            acc = acc + part
        return acc.to(self.dtype)

    def add_rms_norm_in_product(self, x: torch.Tensor, weight: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + self, rms_norm(x + self) * weight), computed by the last program of the pending
        one-row product to finish, bit for bit as the norm kernel of `fused.add_rms_norm` computes
        them (both lay rows of up to `_TAIL_MAX_COLUMNS` out on 4 warps). None where this does not
        apply (launched already, switched off, wider rows, other shapes, or no counter while a
        graph is being captured): the caller adds `sums` itself."""
        cols = self._sums.shape[-1]
        if (self._pending is None or not settings.current().decode_norm_fused or self._sums.shape[1] != 1
                or x.shape != (1, cols) or x.dtype != self.dtype or not x.is_contiguous()
                or weight.shape != (cols,) or weight.dtype != x.dtype or not weight.is_contiguous()
                or x.device != self._sums.device or weight.device != x.device
                or next_power_of_2(cols) > _TAIL_MAX_COLUMNS):
            return None
        counter = _arrival_counter(x.device)
        if counter is None:
            return None
        residual, normed = torch.empty_like(x), torch.empty_like(x)
        self._pending(_NormTail(x, weight, eps, residual, normed, counter))
        self._pending = None
        return residual, normed


class _NormTail(NamedTuple):
    """What the last program of a one-row K-split product adds and norms (`_row_kernel`'s TAIL)."""

    x: torch.Tensor  # the residual [1, N] the product is added to
    weight: torch.Tensor  # the RMSNorm's [N]
    eps: float
    residual: torch.Tensor  # out: x + product, rounded
    normed: torch.Tensor  # out: rms_norm(residual) * weight
    counter: torch.Tensor  # int32 [1], zero between launches: the programs that have arrived


# The last program holds the row in registers (BLOCK = next power of 2) on the product's 4 warps.
# Up to 2048 columns (the 3B shape) that is the norm kernel's layout, and batch 1 gained; at the 7B
# shape's 3584 batch 1 measured 7% slower (H200, docs/bench/norm_tail_h200.md), so wider rows keep
# the norm kernel.
_TAIL_MAX_COLUMNS = 2048
_counters: dict[tuple[str, int], torch.Tensor] = {}


def _arrival_counter(device: torch.device) -> torch.Tensor | None:
    """The arrival counter of the one-row tails on the current stream of `device`. Launches on one
    stream run one after another (each counts only after PDL's wait for the kernel before it), so
    one counter serves them all; the last program sets it back to 0. A stream of its own keeps
    tails of two streams from counting on one counter; a captured graph keeps its capture
    stream's (`graphs.capture` uses one per device), so two pipelines' graphs replayed at once on
    one GPU would share it. Made outside graph capture only (a capture's warm-up runs first, on the
    capture stream); None inside one without it."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[key]


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
    return _takes(x, weight, x.dtype, gated)


def _takes(x: torch.Tensor, weight: torch.Tensor, weight_dtype: torch.dtype, gated: bool) -> bool:
    if torch.compiler.is_compiling():  # traced code keeps F.linear (no guard on the row count)
        return False
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES
            and weight.dtype == weight_dtype and x.stride(1) == 1 and weight.dim() == 2 and weight.stride(1) == 1
            and weight.device == x.device and weight.shape[0] > 0
            and x.shape[1] == weight.shape[1] * (2 if gated else 1) and x.shape[1] > 0 and enabled())


def _bias_ok(bias: torch.Tensor | None, weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    return bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous()
                            and bias.dtype == (dtype or weight.dtype) and bias.device == weight.device)


# ---------------------------------------------------------------------------- FP8 weights
# `quantization="fp8"` (mmpipe.layers.fp8): the same kernels read an FP8 E4M3 weight, widen it in
# registers and multiply each output channel by its float32 scale at the end; the activations stay
# in the model's dtype (weight-only FP8: the step reads half the bytes, nothing else changes).
# Block-scaled weights (a [ceil(N / 128), >= ceil(K / 128)] scale per 128 x 128 tile, FP8
# checkpoints kept as published) multiply each tile's partial sum by its scale instead.

_FP8 = torch.float8_e4m3fn
_SCALE_BLOCK = 128  # the tile of a block-scaled weight (one scale per 128 x 128)


def fp8_usable(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """`usable` for an FP8 weight (with its per-output-channel or 128 x 128 block scales)."""
    return _takes(x, weight, _FP8, gated)


def _check_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               gated: bool = False) -> None:
    n, k = weight.shape
    channel = scale.numel() == n and scale.is_contiguous() and (scale.dim() == 1 or scale.shape[-1] == 1)
    block = (scale.dim() == 2 and scale.shape[0] == cdiv(n, _SCALE_BLOCK) and scale.shape[1] >= cdiv(k, _SCALE_BLOCK)
             and scale.stride(1) == 1)
    if (not fp8_usable(x, weight, gated) or not _bias_ok(bias, weight, x.dtype) or scale.dtype != torch.float32
            or not (channel or block)):
        raise ValueError("gemv FP8: inputs the few-row kernels do not take (see gemv.fp8_usable; a float32 scale "
                         "per output channel or per 128 x 128 block, a bias of x's dtype)")


def _scale_mode(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The kernels' SCALE: 0 none, 1 per output channel, 2 per 128 x 128 block."""
    if scale is None:
        return 0
    return 1 if scale.dim() == 1 or scale.shape[-1] == 1 else 2  # per channel: [N] or [N, 1]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x @ (weight * scale[:, None]).T + bias, rounded to x's dtype once; requires `fp8_usable`."""
    _check_fp8(x, weight, scale, bias)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _run(x, weight, bias, out, splits=1, scale=scale)
    return out


def fp8_linear_split(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, defer: bool = False
                     ) -> torch.Tensor | PartialSums:
    """`fp8_linear` without bias, or its `PartialSums` where splitting K keeps more SMs reading.
    `defer`: a one-row split product may come pending, for `fused.add_rms_norm` to launch with the
    add and norm in its last program; the caller hands it to that add next, on the same stream,
    with `x` unchanged until then (see `PartialSums`)."""
    _check_fp8(x, weight, scale, None)
    return _split_product(x, weight, gated=False, scale=scale, defer=defer)


def fp8_gated_linear_split(gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           defer: bool = False) -> torch.Tensor | PartialSums:
    """`gated_linear_split` for an FP8 weight (`defer` as for `fp8_linear_split`)."""
    _check_fp8(gate_up, weight, scale, None, gated=True)
    return _split_product(gate_up, weight, gated=True, scale=scale, defer=defer)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), converted to `out_dtype` if given (after rounding to x's dtype,
    as `F.linear(...).to(out_dtype)` would)."""
    if (not usable(x, weight) or not _bias_ok(bias, weight)
            or (x.shape[0] > 1 and cdiv(weight.shape[0], _SWAP_BLOCK_N) < _MIN_PROGRAMS // 2)):
        # Several rows, few output tiles and no split to spread them (qkv, 40 tiles): cuBLAS is
        # faster there (H100: 6.9 vs 8.2 us at 8 rows).
        out = F.linear(x, weight, bias)
        return out if out_dtype is None else out.to(out_dtype)
    return kernel_linear(x, weight, bias, out_dtype)


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`linear` on the few-row kernels whatever the shape; requires `usable(x, weight)`."""
    if not usable(x, weight) or not _bias_ok(bias, weight):
        raise ValueError("kernel_linear: inputs the few-row kernels do not take (see gemv.usable; the bias "
                         "must be contiguous, of the weight's rows, dtype and device)")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    _run(x, weight, bias, out, splits=1)
    return out


def linear_split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor | PartialSums:
    """F.linear(x, weight, bias), or its `PartialSums` where splitting K keeps more SMs reading."""
    if not usable(x, weight) or bias is not None:
        return linear(x, weight, bias)
    return _split_product(x, weight, gated=False)


def gated_linear_split(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | PartialSums:
    """F.linear(silu(gate) * up, weight) for gate_up = [gate, up] (halves of the last dimension),
    the SiLU product formed as the weight is read, rounded as `fused.silu_mul` rounds it (so the
    same bits as the two kernels). Requires `usable(gate_up, weight, gated=True)`."""
    if not usable(gate_up, weight, gated=True):
        raise ValueError("gated_linear_split: inputs the few-row kernels do not take (see gemv.usable)")
    return _split_product(gate_up, weight, gated=True)


def _split_product(x: torch.Tensor, weight: torch.Tensor, gated: bool, scale: torch.Tensor | None = None,
                   defer: bool = False) -> torch.Tensor | PartialSums:
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    fp8 = scale is not None
    splits = _splits(rows, n, k, fp8)
    splits = cdiv(k, _k_split(rows, k, splits, fp8))  # no empty slice where rounding K up to blocks ends early
    if splits == 1:
        if not gated and scale is None:
            return linear(x, weight)
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _run(x, weight, None, out, 1, gated, scale)
        return out
    sums = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    if defer and rows == 1 and fp8:  # pending: its reader may have the last program add and norm it
        # (FP8 weights only: with bfloat16 ones, where only down is split, batch 1 measured 1% slower)
        return PartialSums(sums, x.dtype,
                           lambda tail: _run(x, weight, None, sums, splits, gated, scale, tail))
    _run(x, weight, None, sums, splits, gated, scale)
    return PartialSums(sums, x.dtype)


# ---------------------------------------------------------------------------- launch


def _splits(rows: int, n: int, k: int, fp8: bool = False) -> int:
    """K slices for `linear_split` (H100 sweep): one row, a slice per ~2048 of K (down: 4 slices,
    17.2 vs 19.4 us); several rows, enough slices for ~2 programs per SM, at most 4. An FP8 weight
    is half the bytes per slice, so twice the slices, at most 8 (H100, .gpu sweep of this
    session's closing note: down at one row 9.6 us with 8 slices against 12.5 with 4, at 8 rows
    10.9 against 13.4)."""
    if rows == 1:
        splits = 1 << max(0, (k // 2048).bit_length() - 1)
        if fp8 and k // (2 * splits) >= 512:
            splits *= 2
        return min(8, splits)
    limit = 8 if fp8 else 4
    splits = 1
    while cdiv(n, _SWAP_BLOCK_N) * splits < _MIN_PROGRAMS and splits < limit and k // (2 * splits) >= 512:
        splits *= 2
    return splits


def _config(rows: int, k: int, splits: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of the one-row kernel, BLOCK_K of the other (H100 sweep). One row
    of an FP8 weight: longer rows per program unsplit (gate_up 16.3 us with 4 x 2048 on 4 warps
    against 20.9 with bfloat16's 4 x 1024 on 8), more rows per program split (down 9.8 us with
    16 x 512)."""
    if rows == 1:
        if fp8:
            block_n, block_k, warps = (4, 2048, 4) if splits == 1 else (16, 512, 4)
        else:
            block_n, block_k, warps = (4, 1024, 8) if splits == 1 else (8, 512, 4)
        return block_n, min(block_k, max(16, next_power_of_2(k))), warps
    return _SWAP_BLOCK_N, min(128, max(16, next_power_of_2(k))), 4


def _k_split(rows: int, k: int, splits: int, fp8: bool = False) -> int:
    block_k = _config(rows, k, splits, fp8)[1]
    return cdiv(cdiv(k, splits), block_k) * block_k


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, splits: int,
         gated: bool = False, scale: torch.Tensor | None = None, tail: _NormTail | None = None) -> None:
    """Fill `out`: [rows, N] rounded (splits == 1) or [splits, rows, N] float32 partial sums.
    `scale`: float32 per-output-channel scales of an FP8 weight. `tail` (one row, split): its last
    program also adds the sums to `tail.x` and norms the result (`PartialSums.add_rms_norm_in_product`)."""
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
        # Tuned on an H100 (docs/bench/gemv_sweep*_h100_afb45a2.json): 4 rows x 1024 per program unsplit;
        # 8 x 512 when split (more, shorter programs).
        block_n, block_k, warps = _config(rows, k, splits, fp8)
        k_split = _k_split(rows, k, splits, fp8)
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
    # Stages: 3 for unsplit products (gate_up, 8 / 32 rows: 32.6 / 33.4 us against 32.8 / 34.5 with
    # 4, H100, docs/bench/swap_sweep_h100_7ba3d3d.txt; the same order in
    # docs/bench/gemv_sweep2_h100_afb45a2.json), 4 split.
    block_m = max(8, next_power_of_2(rows))
    block_k = _config(rows, k, splits, fp8)[1]
    k_split = _k_split(rows, k, splits, fp8)
    launch(_swap_kernel, (cdiv(n, _SWAP_BLOCK_N), splits), x, weight, b, s, out, rows, n, k, k_split, x.stride(0),
           weight.stride(0), stride_s, HAS_BIAS=has_bias, PARTIAL=splits > 1, GATED=gated, SCALE=mode,
           IEEE=x.dtype == torch.float32,
           BLOCK_M=block_m, BLOCK_N=_SWAP_BLOCK_N, BLOCK_K=block_k, PDL=on, PREFETCH=prefetch, num_warps=4,
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
