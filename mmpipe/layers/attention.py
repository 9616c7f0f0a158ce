"""The attention interface shared by the language model and the vision encoder.

A backend is chosen per device when the models are built and passed to them at construction.
It computes attention only: the language model writes new K/V into its paged cache before the
call (fused with the rotary embedding), so every backend sees the same cache contents and
treats padded rows the same way (their K/V went to the reserved dummy page; their outputs are
don't-care and sliced away by the caller). A backend may also offer `decode_rope`, the rotary,
the K/V write and the attention of a decode step in one call (the CUDA one does).
"""

from __future__ import annotations

import importlib.util
from typing import Generic, Protocol, TypeVar

import torch

MetaT = TypeVar("MetaT", contravariant=True)


class AttentionBackend(Protocol, Generic[MetaT]):
    name: str
    # True when forward reads only device tensors and host values fixed for a captured graph
    # (so it may run inside a CUDA graph and be replayed with new metadata).
    graph_safe: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: MetaT,
                out: torch.Tensor | None = None,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (the new tokens) -> [T, H, D], written into `out` when
        given. `meta` says which rows attend to which; `cache` is the layer's paged (K, V) for
        backends that read earlier tokens from it."""
        ...


def flash_varlen_available() -> bool:
    """Whether `flash_varlen` may be used: a CUDA build of a PyTorch that ships the varlen API
    (`torch.nn.attention.varlen`, found without importing it: its import pulls in torch._dynamo),
    i.e. the versions whose `varlen_attn` mmpipe called before and was tested with."""
    return torch.version.cuda is not None and importlib.util.find_spec("torch.nn.attention.varlen") is not None


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """FlashAttention's varlen forward over the sequences `cu_q` / `cu_k` bound (q [Tq, H, D],
    k/v [Tk, H, D]): the aten op that `torch.nn.attention.varlen.varlen_attn` runs, called without
    that function's custom-op wrapper, whose first call imports `torch._dynamo` (seconds of a
    process's start) and whose every call fills a dropout-state tensor nothing
    reads. `causal` is FlashAttention's bottom-right aligned mask: the last query sees the last
    key, so a cached prefix placed before the new keys is visible to every new query."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                   scale=scale)[0]
