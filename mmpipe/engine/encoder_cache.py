"""Encoder cache: vision embeddings keyed by a hash of the preprocessed pixels, least recently
used first out, bounded in bytes. The same image in a multi-turn chat, or in many requests, is
encoded once. Requests keep their own reference to embeddings they are still prefilling, so an
eviction never takes data from under a running request; it only stops future reuse.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:  # a peek: no hit or miss is counted
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, embeddings: torch.Tensor) -> None:
        size = embeddings.numel() * embeddings.element_size()
        if size > self.capacity or key in self._entries:
            return
        while self.used + size > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.used -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[key] = embeddings
        self.used += size

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0
