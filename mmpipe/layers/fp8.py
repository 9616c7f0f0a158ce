"""FP8 (E4M3) linear layers for `quantization="fp8"`: weights quantized at load, one scale per
output channel; activations quantized per token (one scale per row) at every call; the product
through `torch._scaled_mm` (cuBLASLt's FP8 GEMM with row-wise scales on Hopper/Ada), which reads
half the weight bytes of bfloat16 and runs on the FP8 tensor cores.

The arithmetic, for x [M, K] and W [N, K]:
    w_scale[n] = max_k |W[n, k]| / 448,   Wq = fp8(W / w_scale)
    x_scale[m] = max_k |x[m, k]| / 448,   xq = fp8(x / x_scale)
    y[m, n]    = x_scale[m] * w_scale[n] * sum_k xq[m, k] * Wq[n, k]  (+ bias[n])
Everything is shaped by the rows only (no host sync), so it runs inside the CUDA graphs as is.
Decode steps of up to `gemv.MAX_ROWS` rows take another path, chosen by the model's call sites
(`language/qwen2.py`, `layers/mlp.py`): the few-row kernels read the FP8 weight, widen it in
registers and apply the scales at the end, activations unquantized (`gemv.fp8_linear`).
"""

from __future__ import annotations

import torch
from torch import nn

from mmpipe.kernels.fp8_quant import FP8, FP8_MAX, quantize_per_row  # noqa: F401 (re-exported)


def fp8_shape_ok(linear: nn.Linear) -> bool:
    """cuBLASLt's FP8 GEMM needs both weight dimensions to be multiples of 16 (a layer that is not
    stays in the run's dtype)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def fp8_available(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """`nn.Linear` with an FP8 weight and per-channel scales (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)  # [N, K] fp8
        self.register_buffer("weight_scale", scale.reshape(1, -1).float().contiguous())  # [1, N]
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        weight, scale = quantize_per_row(linear.weight.detach())
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(weight.contiguous(), scale, bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale.t()).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        values, scale = quantize_per_row(rows)  # one Triton kernel on CUDA
        # cuBLASLt takes a bias only in half precision; float32 runs (tests) add it after.
        fused_bias = self.bias is not None and x.dtype in (torch.bfloat16, torch.float16)
        out = torch._scaled_mm(values, self.weight.t(), scale_a=scale, scale_b=self.weight_scale,
                               bias=self.bias if fused_bias else None, out_dtype=x.dtype)
        if self.bias is not None and not fused_bias:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, per-channel scales"


def quantize_linears(module: nn.Module, names: tuple[str, ...]) -> int:
    """Replace every `nn.Linear` child of `module` (recursively) whose attribute name is in
    `names` (and whose shape cuBLASLt takes, `fp8_shape_ok`) by its `Fp8Linear`, one at a time
    (the bfloat16 weight is freed as it goes); returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in names and isinstance(child, nn.Linear) and fp8_shape_ok(child):
                setattr(parent, name, Fp8Linear.from_linear(child))
                replaced += 1
    return replaced
