"""The gated MLP shared by the vision and language models, and the width padding that suits the kernels."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.kernels import gemv
from mmpipe.kernels.fused import silu_mul
from mmpipe.layers.fp8 import Fp8Linear
from mmpipe.layers.parallel import reduce_rows

__all__ = ["GatedMLP", "activation", "padded_width"]

# cuBLAS picks a fast (16-byte aligned) kernel only when a matmul's reduction dimension is a
# multiple of 8 elements; Qwen2.5-VL's vision MLP width, 3420, is not, and its down projection
# runs at a third of the speed (H100: 659 us vs 198 us at 16384 x 3456 x 1280).
KERNEL_ALIGN = 64

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise CheckpointError(f"config.json: unsupported activation {name!r}") from None


def padded_width(hidden: int, multiple: int = KERNEL_ALIGN) -> int:
    return -(-hidden // multiple) * multiple


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul.

    With `few_row_kernels` (the language model's), products of up to `gemv.MAX_ROWS` rows run on
    the decode kernels of `mmpipe.kernels.gemv` and the result may be `gemv.PartialSums` (for
    `add_rms_norm` to add up).

    After loading, `pad_width()` widens the intermediate dimension to a multiple of
    `KERNEL_ALIGN` with zeros: padded gate/up rows (and biases) are zero, so their activations
    are act(0) * 0 = 0, and padded down columns are zero, so they add exactly nothing.
    """

    def __init__(self, dim: int, hidden: int, act: str, bias: bool, few_row_kernels: bool = False) -> None:
        super().__init__()
        self.few_row_kernels = few_row_kernels
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.hidden = hidden
        self.act = activation(act)
        self.silu = act in ("silu", "swish")
        self.tp: Any = None  # a tensor-parallel shard's group (`TPGroup`): the down product is summed over it

    def forward(self, x: torch.Tensor) -> torch.Tensor | gemv.PartialSums:
        return reduce_rows(self.tp, self._product(x))

    def _product(self, x: torch.Tensor) -> torch.Tensor | gemv.PartialSums:
        up, down = self.gate_up_proj, self.down_proj
        if (self.few_row_kernels and self.silu and isinstance(up, Fp8Linear) and isinstance(down, Fp8Linear)
                and down.bias is None and gemv.fp8_usable(x, up.weight)):
            # FP8 weights (`quantization="fp8"`), decode rows: the same kernels reading FP8.
            gate_up = gemv.fp8_linear(x, up.weight, up.weight_scale, up.bias)
            if x.shape[0] == 1 and gemv.fp8_usable(gate_up, down.weight, gated=True):
                return gemv.fp8_gated_linear_split(gate_up, down.weight, down.weight_scale)
            return gemv.fp8_linear_split(silu_mul(gate_up), down.weight, down.weight_scale)
        if (self.few_row_kernels and self.silu and isinstance(down, nn.Linear)
                and gemv.usable(x, self.gate_up_proj.weight)):
            gate_up = gemv.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
            if (x.shape[0] == 1 and self.down_proj.bias is None
                    and gemv.usable(gate_up, self.down_proj.weight, gated=True)):
                # One row: the SiLU product is formed as the weight is read (saves a launch). With
                # more rows the computed operand stalls the tensor-core kernel's pipelined loads
                # (H100, 3B shape, batch 32: +0.8 ms per step), so they keep silu_mul.
                return gemv.gated_linear_split(gate_up, self.down_proj.weight)
            return gemv.linear_split(silu_mul(gate_up), self.down_proj.weight, self.down_proj.bias)
        gate_up = self.gate_up_proj(x)
        if self.silu:
            return self.down_proj(silu_mul(gate_up))  # one kernel on CUDA
        gate, up = gate_up.split(self.hidden, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def pad_width(self, multiple: int = KERNEL_ALIGN) -> None:
        """Re-lay the loaded weights with the intermediate width rounded up to `multiple`."""
        width = padded_width(self.hidden, multiple)
        if width == self.hidden:
            return
        old, inter = self.gate_up_proj, self.hidden
        gate_up = nn.Linear(old.in_features, 2 * width, bias=old.bias is not None,
                            device=old.weight.device, dtype=old.weight.dtype)
        down = self.down_proj  # widened in place
        down_weight = down.weight.new_zeros(down.weight.shape[0], width)
        with torch.no_grad():
            for param in gate_up.parameters():
                param.zero_()
            for block in (0, 1):  # gate rows, then up rows, each block padded at its end
                gate_up.weight[block * width: block * width + inter] = old.weight[block * inter:(block + 1) * inter]
                if old.bias is not None:
                    gate_up.bias[block * width: block * width + inter] = old.bias[block * inter:(block + 1) * inter]
            down_weight[:, :inter] = down.weight
        self.gate_up_proj = gate_up.requires_grad_(False)
        down.weight = nn.Parameter(down_weight, requires_grad=False)
        if isinstance(down, nn.Linear):
            down.in_features = width
        down.requires_grad_(False)
        self.hidden = width
