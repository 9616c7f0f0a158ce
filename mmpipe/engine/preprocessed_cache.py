"""Preprocessed images kept by the content of their encoded file, so the same file given again (a
chat's later turns resend every earlier image; a dataset that repeats an image) is not decoded,
resized and hashed again: once its embeddings are in the encoder cache, that host work is most of
an image request's time to first token.

The key is a hash of the encoded bytes and the preprocessing config (an image part's own size
keys give another entry), so a file rewritten in place is a new entry, never a stale one. Entries
are bounded by the bytes of their resized pixels, least recently used first out; their pixels are
made read-only, since one entry may serve many requests at once. Sources that are decoded already
(PIL images, arrays) are not cached.
"""

from __future__ import annotations

import hashlib
from typing import Any, Hashable

from mmpipe.engine.lru import ByteBoundedLRU


class PreprocessedCache(ByteBoundedLRU[Any]):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, _nbytes)

    @staticmethod
    def key(data: bytes, config: Hashable) -> Hashable:
        return hashlib.blake2b(data, digest_size=16).digest(), config

    def put(self, key: Hashable, image: Any) -> bool:
        if _nbytes(image) <= self.capacity:
            _read_only(image)
        return super().put(key, image)


def _nbytes(image: Any) -> int:
    pixels = getattr(image, "pixels", None)
    if pixels is None:
        return 0
    return int(pixels.nbytes) if hasattr(pixels, "nbytes") else int(pixels.numel() * pixels.element_size())


def _read_only(image: Any) -> None:
    pixels = getattr(image, "pixels", None)
    flags = getattr(pixels, "flags", None)  # a numpy array; a tensor has no such switch
    if flags is not None:
        flags.writeable = False
