"""Language-model attention: metadata, backends, and the custom op that runs them.

`torch` is the reference (any device, not capturable). `cuda` uses Triton kernels for decode
and for extend over a cached prefix, and PyTorch's FlashAttention for plain prefill.
"""

from __future__ import annotations

import torch
from mmpipe.language.attention.metadata import AttentionMetadata
from mmpipe.language.attention.torch_backend import TorchLMAttention

from mmpipe.kernels import triton


def cuda_attention_available(device: torch.device) -> bool:
    return device.type == "cuda" and triton is not None


def make_lm_attention(backend: str, device: torch.device, dtype: torch.dtype, scale: float,
                      extend: str = "auto"):
    """Pick the LM attention implementation: "auto" (cuda when possible), "torch" or "cuda"."""
    if backend == "torch" or (backend == "auto" and not cuda_attention_available(device)):
        return TorchLMAttention(scale)
    if not cuda_attention_available(device):
        raise ValueError(f"attention_backend='cuda' needs a CUDA device and Triton (device is {device})")
    from mmpipe.language.attention.cuda_backend import CudaLMAttention

    return CudaLMAttention(scale, extend)


__all__ = ["AttentionMetadata", "TorchLMAttention", "make_lm_attention", "cuda_attention_available"]
