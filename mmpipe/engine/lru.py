"""A least-recently-used map bounded by the bytes of its values: the encoder cache (vision
embeddings) and the preprocessed-image cache are both this, with their own size measure. Thread-
safe (the preprocessing workers share one). A value larger than the whole bound is not kept; a key
already present keeps its first value (equal keys hold equal contents)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class ByteBoundedLRU(Generic[V]):
    def __init__(self, capacity_bytes: int, size_of: Callable[[V], int]) -> None:
        self.capacity = capacity_bytes
        self.used = 0  # bytes held
        self.hits = self.misses = self.evictions = 0
        self._size_of = size_of
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:  # a peek: no hit or miss is counted
        return key in self._entries

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: V) -> bool:
        """Keep `value` under `key`, evicting the least recently used entries to make room;
        False when it is not kept (too large, or the key is present)."""
        size = self._size_of(value)
        if size > self.capacity:
            return False
        with self._lock:
            if key in self._entries:
                return False
            while self._entries and self.used + size > self.capacity:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.used -= evicted
                self.evictions += 1
            self._entries[key] = (value, size)
            self.used += size
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.used, "hits": self.hits, "misses": self.misses}
