"""The gated MLP shared by the vision and language models, and the width padding that suits the kernels."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.kernels import gemv, gemv_fp8
from mmpipe.kernels.fused import silu_mul
from mmpipe.kernels.partial_sums import PartialSums
from mmpipe.layers.buffers import no_init
from mmpipe.layers.fp8 import Fp8Linear, Fp8Rows, fp8_input
from mmpipe.layers.parallel import reduce_rows

__all__ = ["GatedMLP", "activation", "padded_width"]

# cuBLAS picks a fast (16-byte aligned) kernel only when a matmul's reduction dimension is a
# multiple of 8 elements; Qwen2.5-VL's vision MLP width, 3420, is not, and its down projection
# measured several times slower than at a padded width (docs/performance.md).
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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as raw bytes (copies and zero fills on every device; E4M3's zero is 0x00)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _zeros(like: torch.Tensor, shape: tuple[int, ...], fill: float = 0.0) -> torch.Tensor:
    if like.element_size() == 1 and like.is_floating_point():
        return torch.zeros(shape, dtype=torch.uint8, device=like.device).view(like.dtype)
    return torch.full(shape, fill, dtype=like.dtype, device=like.device)


def _padded_blocks(t: torch.Tensor, inter: int, width: int, fill: float = 0.0) -> torch.Tensor:
    """[2 * inter, ...] (gate rows, then up rows) as [2 * width, ...], each block padded at its end."""
    out = _zeros(t, (2 * width, *t.shape[1:]), fill)
    for block in (0, 1):
        _bytes(out)[block * width: block * width + inter] = _bytes(t)[block * inter:(block + 1) * inter]
    return out


def padded_width(hidden: int, multiple: int = KERNEL_ALIGN) -> int:
    return -(-hidden // multiple) * multiple


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul.

    With `few_row_kernels` (the language model's), products of up to `gemv.MAX_ROWS` rows run on
    the decode kernels of `mmpipe.kernels.gemv` and the result may be `PartialSums` (for
    `add_rms_norm` to add up; one row with FP8 weights: pending, for that add to launch, so the
    caller hands it there next).

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

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor | PartialSums:
        return reduce_rows(self.tp, self._product(x))

    def _product(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor | PartialSums:
        up, down = self.gate_up_proj, self.down_proj
        few_rows = self.few_row_kernels and self.silu and not isinstance(x, Fp8Rows)  # (FP8 rows: never few-row)
        if (few_rows and isinstance(up, Fp8Linear) and isinstance(down, Fp8Linear)
                and down.bias is None and gemv_fp8.fp8_usable(x, up.weight)):
            # FP8 weights (`quantization="fp8"`), decode rows: the same kernels reading FP8.
            gate_up = gemv_fp8.fp8_linear(x, up.weight, up.weight_scale, up.bias)
            if x.shape[0] == 1 and gemv_fp8.fp8_usable(gate_up, down.weight, gated=True):
                return gemv_fp8.fp8_gated_linear_split(gate_up, down.weight, down.weight_scale, defer=True)
            return gemv_fp8.fp8_linear_split(silu_mul(gate_up), down.weight, down.weight_scale, defer=True)
        if (few_rows and isinstance(down, nn.Linear)
                and gemv.usable(x, self.gate_up_proj.weight)):
            gate_up = gemv.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
            if (x.shape[0] == 1 and self.down_proj.bias is None
                    and gemv.usable(gate_up, self.down_proj.weight, gated=True)):
                # One row: the SiLU product is formed as the weight is read (saves a launch). With
                # more rows the computed operand stalls the tensor-core kernel's pipelined loads
                # (measured slower; docs/performance.md), so they keep silu_mul.
                return gemv.gated_linear_split(gate_up, self.down_proj.weight)
            return gemv.linear_split(silu_mul(gate_up), self.down_proj.weight, self.down_proj.bias)
        gate_up = self.gate_up_proj(x)
        if self.silu:  # one kernel on CUDA, FP8 rows where the down projection would quantize its input
            act = silu_mul(gate_up, fp8_input(down, gate_up, gated=True))
            if isinstance(down, Fp8Linear):  # the language model's consumer adds K-split partial sums
                return down(act, split=self.few_row_kernels)
            return down(act)
        gate, up = gate_up.split(self.hidden, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def pad_width(self, multiple: int = KERNEL_ALIGN) -> None:
        """Re-lay the loaded weights with the intermediate width rounded up to `multiple` (zero
        rows and columns). FP8 layers stay FP8: padded rows get scale 1; block-scaled layers never
        need this (their widths are multiples of 128, `mmpipe.weights.place_fp8_layers`)."""
        width = padded_width(self.hidden, multiple)
        if width == self.hidden:
            return
        old, down, inter = self.gate_up_proj, self.down_proj, self.hidden
        if any(isinstance(m, Fp8Linear) and m.block for m in (old, down)):
            raise ValueError(f"GatedMLP.pad_width: a block-scaled FP8 layer of width {inter} cannot be padded")
        weight = _padded_blocks(old.weight, inter, width)  # gate rows, then up rows, each padded at its end
        bias = _padded_blocks(old.bias, inter, width) if old.bias is not None else None
        if isinstance(old, Fp8Linear):
            scale = _padded_blocks(old.weight_scale, inter, width, fill=1.0)
            gate_up: nn.Module = Fp8Linear(weight, scale, bias)
        else:
            # Built on the meta device: its parameters are replaced at once (no random init to discard).
            with no_init():
                gate_up = nn.Linear(old.in_features, 2 * width, bias=bias is not None, device="meta",
                                    dtype=weight.dtype)
            gate_up.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                gate_up.bias = nn.Parameter(bias, requires_grad=False)
        self.gate_up_proj = gate_up.requires_grad_(False)
        down_weight = _zeros(down.weight, (down.weight.shape[0], width))  # widened in place
        _bytes(down_weight)[:, :inter] = _bytes(down.weight)
        if isinstance(down, Fp8Linear):
            down.weight = down_weight  # a buffer; its per-channel (per output row) scales stay
        else:
            down.weight = nn.Parameter(down_weight, requires_grad=False)
        if isinstance(down, (nn.Linear, Fp8Linear)):
            down.in_features = width
        down.requires_grad_(False)
        self.hidden = width
