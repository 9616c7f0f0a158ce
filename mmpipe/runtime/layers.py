"""Small layers shared by the vision and language models."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.runtime.fused import add_rms_norm, rotate_half, silu_mul

__all__ = ["GatedMLP", "RMSNorm", "activation", "rotate_half"]

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


class RMSNorm(nn.Module):
    """Normalise in float32, scale in the model dtype (the Qwen rounding order)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[1]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.hidden = hidden
        self.act = activation(act)
        self.silu = act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu:
            return self.down_proj(silu_mul(gate_up))  # one kernel on CUDA
        gate, up = gate_up.split(self.hidden, dim=-1)
        return self.down_proj(self.act(gate) * up)
