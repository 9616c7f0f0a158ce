"""Prefix-cache keys: what a full KV page's contents depend on, as one chained hash.

A page's K/V depend on every token up to its end: their ids, their M-RoPE positions, and for
image and video tokens the pixels behind them (image token ids are all alike). A page's key
hashes its parent page's key, its token ids, their positions, and the content hash and offset
of every image or video frame group whose tokens fall in it; a request's salt, when given, seeds
the chain, so its pages are never found by a request without the same salt. Positions cover what
else shapes them (grids, a video's timestamps); the image hashes cover the pixels and their
preprocessing (`ImageInput.key`).
"""

from __future__ import annotations

import bisect
import hashlib

import numpy as np

from mmpipe.engine.request import Request

DIGEST_BYTES = 16


def chain_root(salt: str | None) -> bytes:
    """The parent of a sequence's first page."""
    return b"" if not salt else hashlib.blake2b(b"salt\0" + salt.encode(), digest_size=DIGEST_BYTES).digest()


def extend_keys(request: Request, pages: int, page_size: int) -> list[bytes]:
    """The keys of the request's first `pages` full pages (each computed once, kept on the request);
    every token of them must be known on the host."""
    keys = request.cache_keys
    while len(keys) < pages:
        index = len(keys)
        parent = keys[-1] if keys else chain_root(request.sampling.cache_salt)
        keys.append(page_key(request, parent, index * page_size, (index + 1) * page_size))
    return keys


def page_key(request: Request, parent: bytes, start: int, end: int) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    digest.update(np.asarray(request.tokens(start, end), dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(request.positions_of(start, end), dtype=np.int64).tobytes())
    for first, image in media_in(request, start, end):
        digest.update(f"{image.key}@{first - start};".encode())
    return digest.digest()


def media_in(request: Request, start: int, end: int) -> list[tuple[int, object]]:
    """(first token, image) of every image or frame group with tokens in [start, end)."""
    starts = request.image_starts
    found = []
    index = bisect.bisect_left(starts, end) - 1  # the last one starting before `end`
    while index >= 0 and starts[index] + request.images[index].num_tokens > start:
        found.append((starts[index], request.images[index]))
        index -= 1
    return found[::-1]
