"""Prefix-cache keys: what a full KV page's contents depend on, as one chained hash.

A page's K/V depend on every token up to its end: their ids, their M-RoPE positions, and for
image and video tokens the pixels behind them (image token ids are all alike). A page's key
hashes its parent page's key, its token ids, their positions, and the content hash and offset
of every image or video frame group whose tokens fall in it; a request's salt, when given, seeds
the chain, so its pages are never found by a request without the same salt. Positions cover what
else shapes them (grids, a video's timestamps); the image hashes cover the pixels and their
preprocessing (`ImageInput.key`).

Hashing costs a few microseconds a page; `key_memo` spares a prompt that repeats a recent one's
beginning from hashing those pages again.
"""

from __future__ import annotations

import hashlib

import numpy as np

from mmpipe.engine.request import Request

DIGEST_BYTES = 16


def chain_root(salt: str | None) -> bytes:
    """The parent of a sequence's first page."""
    return b"" if not salt else hashlib.blake2b(b"salt\0" + salt.encode(), digest_size=DIGEST_BYTES).digest()


def _token_rows(request: Request, start: int, end: int) -> memoryview:
    """Tokens [start, end) as bytes, four int32 each: the id, then its three M-RoPE positions."""
    rows = np.empty((end - start, 4), dtype=np.int32)
    rows[:, 0] = request.tokens(start, end)
    rows[:, 1:] = np.asarray(request.positions_of(start, end)).T
    return memoryview(rows).cast("B")


def image_spans(request: Request, start: int, end: int) -> list[tuple[int, int, str]]:
    """(first token, end, key) of every image or frame group with tokens in [start, end)."""
    return [(first, first + image.num_tokens, image.key) for first, image in zip(request.image_starts, request.images)
            if first + image.num_tokens > start and first < end]


def extend_keys(request: Request, pages: int, page_size: int) -> list[bytes]:
    """The keys of the request's first `pages` full pages (each computed once, kept on the request);
    every token of them must be known on the host."""
    keys = request.cache_keys
    done = len(keys)
    if done >= pages:
        return keys
    start, end = done * page_size, pages * page_size
    data, step = _token_rows(request, start, end), page_size * 16  # a page's bytes are one slice
    spans = image_spans(request, start, end)
    parent = keys[-1] if keys else chain_root(request.sampling.cache_salt)
    span = 0
    for index in range(done, pages):
        lo, hi = index * page_size, (index + 1) * page_size
        digest = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        digest.update(data[(lo - start) * 16:(lo - start) * 16 + step])
        while span < len(spans) and spans[span][1] <= lo:  # spans ending before this page
            span += 1
        for first, _, key in spans[span:]:
            if first >= hi:
                break
            digest.update(f"{key}@{first - lo};".encode())
        parent = digest.digest()
        keys.append(parent)
    return keys


def prompt_key(request: Request, full_pages: int, page_size: int) -> bytes:
    """The key of the request's whole prompt: the chain of its first `full_pages` pages, then
    the tokens after them (their ids, positions and images, as a page's), under a tag no page key
    carries. Logits of the prompt's last position are kept under it (`FirstTokenCache`)."""
    keys = extend_keys(request, full_pages, page_size)
    parent = keys[full_pages - 1] if full_pages else chain_root(request.sampling.cache_salt)
    start, end = full_pages * page_size, request.prompt_len
    digest = hashlib.blake2b(parent + b"\0prompt", digest_size=DIGEST_BYTES)
    digest.update(_token_rows(request, start, end))
    for first, _, key in image_spans(request, start, end):
        digest.update(f"{key}@{first - start};".encode())
    return digest.digest()
