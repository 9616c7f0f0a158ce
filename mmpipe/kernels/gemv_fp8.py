"""The few-row products (`gemv`) for FP8 weights: weight-only FP8 in decode steps.

With `quantization="fp8"` (mmpipe.layers.fp8) the same kernels read an FP8 E4M3 weight, widen it
in registers and multiply each output channel by its float32 scale at the end; the activations
stay in the model's dtype, so the step reads half the bytes and nothing else changes.
Block-scaled weights (a [ceil(N / 128), >= ceil(K / 128)] scale per 128 x 128 tile, FP8
checkpoints kept as published) multiply each tile's partial sum by its scale instead. The rule of
which inputs the kernels take is `gemv`'s, for an FP8 weight; a one-row split product may come
pending, for the residual add + RMSNorm after it to finish in its last program (`partial_sums`).
"""

from __future__ import annotations

import torch

from mmpipe.kernels.gemv import bias_ok, split_product, takes
from mmpipe.kernels.gemv_kernels import run
from mmpipe.kernels.launch import cdiv
from mmpipe.kernels.partial_sums import PartialSums

__all__ = ["fp8_gated_linear_split", "fp8_linear", "fp8_linear_split", "fp8_usable"]

_FP8 = torch.float8_e4m3fn
_SCALE_BLOCK = 128  # the tile of a block-scaled weight (one scale per 128 x 128)


def fp8_usable(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """`gemv.usable` for an FP8 weight (with its per-output-channel or 128 x 128 block scales)."""
    return takes(x, weight, _FP8, gated)


def _check_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               gated: bool = False) -> None:
    n, k = weight.shape
    channel = scale.numel() == n and scale.is_contiguous() and (scale.dim() == 1 or scale.shape[-1] == 1)
    block = (scale.dim() == 2 and scale.shape[0] == cdiv(n, _SCALE_BLOCK) and scale.shape[1] >= cdiv(k, _SCALE_BLOCK)
             and scale.stride(1) == 1)
    if (not fp8_usable(x, weight, gated) or not bias_ok(bias, weight, x.dtype) or scale.dtype != torch.float32
            or not (channel or block)):
        raise ValueError("gemv FP8: inputs the few-row kernels do not take (see gemv_fp8.fp8_usable; a float32 "
                         "scale per output channel or per 128 x 128 block, a bias of x's dtype)")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x @ (weight * scale[:, None]).T + bias, rounded to x's dtype once; requires `fp8_usable`."""
    _check_fp8(x, weight, scale, bias)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    run(x, weight, bias, out, splits=1, scale=scale)
    return out


def fp8_linear_split(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, defer: bool = False
                     ) -> torch.Tensor | PartialSums:
    """`fp8_linear` without bias, or its `PartialSums` where splitting K keeps more SMs reading.
    `defer`: a one-row split product may come pending, for `fused.add_rms_norm` to launch with the
    add and norm in its last program; the caller hands it to that add next, on the same stream,
    with `x` unchanged until then (see `PartialSums`)."""
    _check_fp8(x, weight, scale, None)
    return split_product(x, weight, gated=False, scale=scale, defer=defer)


def fp8_gated_linear_split(gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           defer: bool = False) -> torch.Tensor | PartialSums:
    """`gated_linear_split` for an FP8 weight (`defer` as for `fp8_linear_split`)."""
    _check_fp8(gate_up, weight, scale, None, gated=True)
    return split_product(gate_up, weight, gated=True, scale=scale, defer=defer)

