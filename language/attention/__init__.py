"""Language-model attention: metadata, the reference backend, and the custom op."""

from __future__ import annotations

import torch

from language.attention.metadata import AttentionMetadata
from language.attention.torch_backend import TorchLMAttention


def make_lm_attention(backend: str, device: torch.device, dtype: torch.dtype, scale: float):
    """Pick the LM attention implementation for a device ("auto", "torch" or "cuda")."""
    if backend == "cuda":
        raise NotImplementedError("the CUDA LM attention backend is not built yet; use 'auto' or 'torch'")
    return TorchLMAttention(scale)


__all__ = ["AttentionMetadata", "TorchLMAttention", "make_lm_attention"]
