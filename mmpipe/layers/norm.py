"""RMSNorm in the Qwen rounding order, as one fused kernel on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from mmpipe.kernels.fused import add_rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Normalise in float32, scale in the model dtype (the Qwen rounding order)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[1]
