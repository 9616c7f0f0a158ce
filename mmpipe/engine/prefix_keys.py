"""Prefix-cache keys: what a full KV page's contents depend on, as one chained hash.

A page's K/V depend on every token up to its end: their ids, their M-RoPE positions, and for
image and video tokens the pixels behind them (image token ids are all alike). A page's key
hashes its parent page's key, its token ids, their positions, and the content hash and offset
of every image or video frame group whose tokens fall in it; a request's salt, when given, seeds
the chain, so its pages are never found by a request without the same salt. Positions cover what
else shapes them (grids, a video's timestamps); the image hashes cover the pixels and their
preprocessing (`ImageInput.key`).

Hashing costs a few microseconds a page, so a chat's next turn, whose prompt repeats the previous
turn's, would pay for every page of its history at admission. `KeyMemo` remembers recent requests
by the key of their first page; a new request with the same first page takes the keys of the
leading pages whose inputs (ids, positions, images) equal that request's, compared directly, and
hashes only the pages after them. The keys are those hashing would give: only their cost changes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

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


def _spans(request: Request, start: int, end: int) -> list[tuple[int, int, str]]:
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
    spans = _spans(request, start, end)
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
    for first, _, key in _spans(request, start, end):
        digest.update(f"{key}@{first - start};".encode())
    return digest.digest()


class KeyMemo:
    """Recently hashed prompts by the key of their first page (the newest for each), each as its
    leading pages' token ids, positions, images and keys, at most `capacity_tokens` tokens in all:
    a new request with the same first page takes the keys of the leading pages it shares with
    that one."""

    def __init__(self, capacity_tokens: int = 1 << 20) -> None:
        self.capacity_tokens = capacity_tokens
        self._by_first: OrderedDict[bytes, _Known] = OrderedDict()
        self._tokens = 0
        self.reused_pages = 0

    def seed(self, request: Request, pages: int, page_size: int) -> None:
        """Give `request`, which has no key yet, its first page's key and the keys of its next
        leading pages, up to `pages`, whose ids, positions and images equal those of the prompt
        remembered under that key; then remember its own first `pages` in that one's place."""
        if request.cache_keys or pages < 2:
            return
        first = extend_keys(request, 1, page_size)[0]
        end = pages * page_size
        mine = _Known(request.tokens(0, end), request.positions_of(0, end), _spans(request, 0, end),
                      request.cache_keys)  # the request's own key list: keys hashed later join it
        known = self._by_first.pop(first, None)
        if known is not None:
            self._tokens -= len(known.ids)
            common = min(len(known.keys), mine.equal_pages(known, page_size))
            if common > 1:
                request.cache_keys.extend(known.keys[1:common])
                self.reused_pages += common - 1
        if end <= self.capacity_tokens:
            self._by_first[first] = mine
            self._tokens += end
        while self._tokens > self.capacity_tokens:
            self._tokens -= len(self._by_first.popitem(last=False)[1].ids)


class _Known:
    """What a prompt's leading page keys depend on (see the module docstring), and the keys."""

    def __init__(self, ids: list[int], positions: np.ndarray, spans: list[tuple[int, int, str]],
                 keys: list[bytes]) -> None:
        self.ids, self.positions, self.spans, self.keys = ids, positions, spans, keys

    def equal_pages(self, other: _Known, page_size: int) -> int:
        """How many leading full pages the two have in common."""
        pages = min(len(self.ids), len(other.ids)) // page_size
        mine, theirs = self.ids, other.ids  # list comparisons run in C; each slice is compared once
        if mine[:pages * page_size] != theirs[:pages * page_size]:
            low, high = 0, pages  # the first `low` pages are equal, the first `high` are not
            while high - low > 1:
                middle = (low + high) // 2
                span = slice(low * page_size, middle * page_size)
                low, high = (middle, high) if mine[span] == theirs[span] else (low, middle)
            pages = low
        end = pages * page_size
        differ = np.flatnonzero((self.positions[:, :end] != other.positions[:, :end]).any(axis=0))
        same = int(differ[0]) if differ.size else end
        for i in range(max(len(self.spans), len(other.spans))):  # the first image they do not share
            a = self.spans[i] if i < len(self.spans) else None
            b = other.spans[i] if i < len(other.spans) else None
            if a != b:  # pages from its first token on differ
                same = min(same, *(s[0] for s in (a, b) if s is not None))
                break
        return same // page_size
