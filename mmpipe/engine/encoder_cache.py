"""Encoder cache: vision embeddings keyed by a hash of the preprocessed pixels, least recently
used first out, bounded in bytes. The same image in a multi-turn chat, or in many requests, is
encoded once. Requests keep their own reference to embeddings they are still prefilling, so an
eviction never takes data from under a running request; it only stops future reuse.
"""

from __future__ import annotations

import torch

from mmpipe.engine.lru import ByteBoundedLRU


class EncoderCache(ByteBoundedLRU[torch.Tensor]):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, lambda embeddings: embeddings.numel() * embeddings.element_size())
