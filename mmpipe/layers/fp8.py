"""FP8 (E4M3) linear layers for `quantization="fp8"`: weights quantized at load, one scale per
output channel; activations quantized per token (one scale per row) at every call; the product
through `torch._scaled_mm` (cuBLASLt's FP8 GEMM with row-wise scales on Hopper/Ada), which reads
half the weight bytes of bfloat16 and runs on the FP8 tensor cores; decode steps of 33-256 rows
through mmpipe's Triton FP8 GEMM instead, where it is faster (`mmpipe.kernels.fp8_gemm.pick`),
with `split=True` possibly as K-split `PartialSums` for the caller to add up.

The arithmetic, for x [M, K] and W [N, K]:
    w_scale[n] = max_k |W[n, k]| / 448,   Wq = fp8(W * (1 / w_scale))
    x_scale[m] = max_k |x[m, k]| / 448,   xq = fp8(x * (1 / x_scale))
    y[m, n]    = x_scale[m] * w_scale[n] * sum_k xq[m, k] * Wq[n, k]  (+ bias[n])
(each reciprocal IEEE-rounded in float32, as `mmpipe.kernels.fp8_quant` computes it).
Everything is shaped by the rows only (no host sync), so it runs inside the CUDA graphs as is.
Decode steps of up to `gemv.MAX_ROWS` rows take another path, chosen by the model's call sites
(`language/qwen2.py`, `layers/mlp.py`): the few-row kernels read the FP8 weight, widen it in
registers and apply the scales at the end, activations unquantized (`gemv_fp8.fp8_linear`).

Block-scaled weights (FP8 checkpoints in the Qwen team's `weight_block_size: [128, 128]` format,
kept as published): one scale per 128 x 128 tile of W, activations quantized per token and
128-column group, the product through cuBLASLt's block-scaled FP8 GEMM (`F.scaled_mm` with
BlockWise1x128 x BlockWise128x128); the few-row kernels apply each tile's scale to its partial
sum. Off CUDA the same arithmetic runs in float32 (`_reference_block_product`), for tests.

A layer also takes its input already quantized (`Fp8Rows`): where `fp8_input` says how the layer
would quantize its input (per row, or per row and 128-column group), the kernel that makes the
input (the RMSNorm before qkv and gate_up, the SiLU product before down) writes it in FP8 at
once, one pass fewer over the activations, with the same bits (`MMPIPE_DISABLE=fp8-fused-quant` turns
this off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmpipe import settings
from mmpipe.kernels import fp8_gemm, gemv_fp8
from mmpipe.kernels.fp8_quant import (  # noqa: F401 (re-exported)
    FP8,
    FP8_MAX,
    GEMM_ROW_MULTIPLE,
    Fp8Rows,
    quantize_per_group,
    quantize_per_row,
)
from mmpipe.kernels.partial_sums import PartialSums

BLOCK = 128  # the weight tile that block-scaled layers (and their kernels) take: 128 x 128


def fp8_shape_ok(linear: nn.Linear) -> bool:
    """cuBLASLt's FP8 GEMM needs both weight dimensions to be multiples of 16 (a layer that is not
    stays in the run's dtype)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def fp8_input(layer: nn.Module | None, like: torch.Tensor, gated: bool = False) -> int | None:
    """How `layer`'s product of an input shaped like `like` quantizes that input: 0 per row (a
    per-channel `Fp8Linear`), `BLOCK` per row and 128-column group (a block-scaled one), None when
    it does not, or may not (not FP8, `MMPIPE_DISABLE=fp8-fused-quant`, or rows the few-row kernels
    would take: `gemv_fp8.fp8_usable`, also where the caller then multiplies otherwise, as the ViT
    does with <= 32 rows, which only leaves those unfused). The kernel making the input may then
    hand it over quantized that way (`Fp8Rows`). `gated`: `like` is the fused [gate, up]
    projection whose SiLU product is the input. Code traced by `torch.compile` (the `inductor`
    prefill compiler) keeps the separate quantizer: the fused kernels are tested eagerly and in
    CUDA graphs only."""
    if (not isinstance(layer, Fp8Linear) or like.dim() != 2 or not settings.current().fp8_fused_quant
            or torch.compiler.is_compiling() or gemv_fp8.fp8_usable(like, layer.weight, gated)):
        return None
    return BLOCK if layer.block else 0


def fp8_available(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def block_scale_columns(in_features: int) -> int:
    """Columns of a block-scaled layer's scale tensor: one per 128 input columns, rounded up to a
    multiple of 4 (cuBLASLt's layout for 128x128 scales; the extra columns are never read)."""
    return -(-(-(-in_features // BLOCK)) // 4) * 4


class Fp8Linear(nn.Module):
    """`nn.Linear` with an FP8 weight: per-channel scales ([N, 1]) or, with `block`, one scale per
    128 x 128 tile ([ceil(N / 128), block_scale_columns(K)]); see the module docstring."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 block: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.block = block
        if block:
            want = (-(-self.out_features // BLOCK), block_scale_columns(self.in_features))
            if tuple(scale.shape) != want:
                raise ValueError(f"Fp8Linear: block scales of shape {want} expected, got {tuple(scale.shape)}")
        else:
            scale = scale.reshape(-1, 1)
        self.register_buffer("weight", weight)  # [N, K] fp8
        self.register_buffer("weight_scale", scale.float().contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        weight, scale = quantize_per_row(linear.weight.detach())
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(weight.contiguous(), scale, bias)

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool, dtype: torch.dtype, block: bool,
              device: torch.device | str = "meta") -> "Fp8Linear":
        """A layer to load an FP8 checkpoint's weights into (`mmpipe.weights.load_checkpoint`)."""
        rows = (-(-out_features // BLOCK), block_scale_columns(in_features)) if block else (out_features, 1)
        return cls(torch.empty(out_features, in_features, dtype=FP8, device=device),
                   torch.ones(rows, dtype=torch.float32, device=device),
                   torch.empty(out_features, dtype=dtype, device=device) if bias else None, block)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self._full_scale()).to(dtype)

    def _full_scale(self) -> torch.Tensor:
        if not self.block:
            return self.weight_scale
        n, k = self.weight.shape
        return self.weight_scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]

    def forward(self, x: torch.Tensor | Fp8Rows, split: bool = False) -> torch.Tensor | PartialSums:
        """x @ W.T (+ bias) in x's dtype. `split` (2-D x, no bias): the caller adds `PartialSums`
        up itself, so a K-split product may come as them (`fp8_gemm.pick`)."""
        split = split and self.bias is None
        if isinstance(x, Fp8Rows):
            if x.group != (BLOCK if self.block else 0) or x.values.shape[-1] != self.in_features:
                how = f"per {x.group} columns" if x.group else "per row"
                raise ValueError(f"Fp8Linear: activations quantized {how} with width {x.values.shape[-1]} "
                                 f"given to {self.extra_repr()}")
            if self.block:
                return self._block_scaled(x.values, x.scale, x.dtype, x.shape[0], split)
            return self._scaled_product(x.values, x.scale, x.dtype, split)
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        split = split and x.dim() == 2
        if self.block:
            out = self._block_product(rows, split)
        else:
            out = self._channel_product(rows, split)
        return out if isinstance(out, PartialSums) else out.reshape(*shape[:-1], self.out_features)

    def _channel_product(self, rows: torch.Tensor, split: bool) -> torch.Tensor | PartialSums:
        values, scale = quantize_per_row(rows)  # one Triton kernel on CUDA
        return self._scaled_product(values, scale, rows.dtype, split)

    def _triton_config(self, rows: int, values: torch.Tensor, split: bool) -> fp8_gemm.Config | None:
        # `pick` first: a prefill's product (> 256 rows) is turned away by its first comparison
        config = fp8_gemm.pick(rows, self.out_features, self.in_features, self.block, split, values.device)
        return config if config is not None and fp8_gemm.usable(values, self.weight) else None

    def _scaled_product(self, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, split: bool = False
                        ) -> torch.Tensor | PartialSums:
        config = self._triton_config(values.shape[0], values, split)
        if config is not None:  # decode rows above the few-row kernels (see fp8_gemm)
            return fp8_gemm.fp8_gemm(values, scale, self.weight, self.weight_scale, config, dtype, self.bias)
        # cuBLASLt takes a bias only in half precision; float32 runs (tests) add it after.
        fused_bias = self.bias is not None and dtype in (torch.bfloat16, torch.float16)
        out = torch._scaled_mm(values, self.weight.t(), scale_a=scale, scale_b=self.weight_scale.view(1, -1),
                               bias=self.bias if fused_bias else None, out_dtype=dtype)
        if self.bias is not None and not fused_bias:
            out = out + self.bias
        return out

    def _block_product(self, rows: torch.Tensor, split: bool) -> torch.Tensor | PartialSums:
        values, scale = quantize_per_group(rows, BLOCK, GEMM_ROW_MULTIPLE if rows.is_cuda else 1)  # one Triton kernel
        return self._block_scaled(values, scale, rows.dtype, rows.shape[0], split)

    def _block_scaled(self, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, count: int,
                      split: bool = False) -> torch.Tensor | PartialSums:
        config = self._triton_config(count, values, split)
        if config is not None:
            return fp8_gemm.fp8_gemm(values, scale, self.weight, self.weight_scale, config, dtype, self.bias,
                                     group=BLOCK, rows=count)
        if values.is_cuda:
            out = F.scaled_mm(values, self.weight.t(), scale, F.ScalingType.BlockWise1x128, self.weight_scale.t(),
                              F.ScalingType.BlockWise128x128, output_dtype=dtype)[:count]
        else:
            out = _reference_block_product(values[:count], scale[:count], self.weight, self._full_scale()).to(dtype)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        scales = "128x128 block scales" if self.block else "per-channel scales"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, {scales}"


def _reference_block_product(values: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                             weight_scale: torch.Tensor) -> torch.Tensor:
    """What the block-scaled GEMM computes, in float32 (CPU runs and tests)."""
    x = values.float() * scale.repeat_interleave(BLOCK, 1)[:, :values.shape[1]]
    return x @ (weight.float() * weight_scale).t()


def quantize_linears(module: nn.Module, names: tuple[str, ...]) -> int:
    """Replace every `nn.Linear` child of `module` (recursively) whose attribute name is in
    `names` (and whose shape cuBLASLt takes, `fp8_shape_ok`) by its `Fp8Linear`, one at a time;
    returns how many were replaced. Only the parents' names are held while it runs, so each
    replaced layer's weight is freed before the next is quantized: the peak is the unquantized
    model plus one layer."""
    replaced = 0
    for path in [path for path, _ in module.named_modules()]:
        parent = module.get_submodule(path)
        for name in [n for n, child in parent.named_children() if n in names and isinstance(child, nn.Linear)]:
            if fp8_shape_ok(getattr(parent, name)):
                setattr(parent, name, Fp8Linear.from_linear(getattr(parent, name)))
                replaced += 1
    return replaced
