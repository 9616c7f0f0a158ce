"""Page keys taken from a recent prompt instead of hashed again.

Hashing a page (`prefix_keys`) costs a few microseconds, so a chat's next turn, whose prompt
repeats the previous turn's prompt and answer, would pay for every page of its history at
admission. `KeyMemo` remembers recent prompts, grouped by the key of their first `GROUP_PAGES`
pages (a short system prompt and the start of the first question: chats with one long system
prompt share a group, a stream of captions of new images shares none); a new request hashes
those pages, picks the member of its group that agrees with it longest, compares their token ids,
positions and images directly, and takes the keys of the leading pages found equal. It hashes only
the pages after them. The keys are those hashing would give: only their cost changes.

A member holds the request's own key list while the request runs (keys hashed after admission
join it); when the request finishes, its ids, positions and images are extended to every page
it has a key for, its answer included, and the list is copied, so the next turn takes the keys
of the answer's pages too.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from mmpipe.engine.prefix_keys import extend_keys, image_spans
from mmpipe.engine.request import Request

Span = tuple[int, int, str]
GROUP_PAGES = 2  # pages hashed to find a request's group


class KeyMemo:
    """Recent prompts, at most `per_group` for a group and `capacity_tokens` tokens in all
    (the least recently used group's oldest member goes first)."""

    def __init__(self, capacity_tokens: int = 1 << 19, per_group: int = 64) -> None:
        self.capacity_tokens, self.per_group = capacity_tokens, per_group
        self._groups: OrderedDict[bytes, list[_Known]] = OrderedDict()  # members oldest first
        self._tokens = 0
        self.reused_pages = 0

    def seed(self, request: Request, pages: int, page_size: int) -> None:
        """Give `request`, which has no key yet, the keys of its first `GROUP_PAGES` pages, hashed,
        and of the next leading pages, up to `pages`, that it shares with the remembered prompt of
        its group agreeing with it longest; then remember its first `pages`, in place of the
        prompts it begins with."""
        if request.cache_keys or pages <= GROUP_PAGES:
            return
        first = extend_keys(request, GROUP_PAGES, page_size)[-1]
        end = pages * page_size
        mine = _Known(request, request.tokens(0, end), request.positions_of(0, end), image_spans(request, 0, end),
                      request.cache_keys)
        group = self._groups.pop(first, [])
        # The candidate: the furthest probe, then the longest prompt, then the newest.
        best = max(reversed(group), key=lambda known: (mine.reach(known, page_size), len(known.ids)), default=None)
        if best is not None:
            equal = mine.equal_pages(best, page_size)
            mine.base = (weakref.ref(best), equal)
            common = min(len(best.keys), equal)
            if common > GROUP_PAGES:
                request.cache_keys.extend(best.keys[GROUP_PAGES:common])
                self.reused_pages += common - GROUP_PAGES
        if end <= self.capacity_tokens:
            group.append(mine)
            self._tokens += end
            self._drop_covered(group, mine, page_size)  # earlier turns of this conversation
        if len(group) > self.per_group:
            self._tokens -= len(group.pop(0).ids)
        if group:
            self._groups[first] = group
        self._evict()

    def finished(self, request: Request, page_size: int) -> None:
        """The request is done: its member, if any, covers every page it has a key for (its
        answer too) and keeps a copy of those keys, not the request's list."""
        keys = request.cache_keys
        group = self._groups.get(keys[GROUP_PAGES - 1]) if len(keys) >= GROUP_PAGES else None
        for known in group or ():
            if known.request is not None and known.request() is request:
                known.request = None
                end = min(len(keys), request.total_len // page_size) * page_size
                known.keys = keys[:max(end, len(known.ids)) // page_size]
                if end > len(known.ids):  # pages past the prompt's: its answer
                    self._tokens += end - len(known.ids)
                    known.ids, known.positions = request.tokens(0, end), request.positions_of(0, end)
                    known.spans = image_spans(request, 0, end)
                    self._drop_covered(group, known, page_size)
                    self._evict()
                known.base = None
                return

    def _drop_covered(self, group: list[_Known], known: _Known, page_size: int) -> None:
        """Forget the group's other prompts that `known` begins with (it serves whatever they would)."""
        for other in [other for other in group if other is not known and known.covers(other, page_size)]:
            group.remove(other)
            self._tokens -= len(other.ids)

    def _evict(self) -> None:
        while self._tokens > self.capacity_tokens and self._groups:
            key, group = next(iter(self._groups.items()))
            self._tokens -= len(group.pop(0).ids)
            if not group:
                del self._groups[key]


class _Known:
    """What a prompt's leading page keys depend on (see `prefix_keys`), the keys, and its request
    until it finishes."""

    def __init__(self, request: Request, ids: list[int], positions: np.ndarray, spans: list[Span],
                 keys: list[bytes]) -> None:
        self.request: weakref.ref[Request] | None = weakref.ref(request)  # None once it finished
        self.ids, self.positions, self.spans, self.keys = ids, positions, spans, keys
        self.base: tuple[weakref.ref[_Known], int] | None = None  # the prompt it was compared with, pages equal

    def first_unshared_image(self, other: _Known) -> int:
        """The first token of the first image the two do not share (their length if none)."""
        for i in range(max(len(self.spans), len(other.spans))):
            a = self.spans[i] if i < len(self.spans) else None
            b = other.spans[i] if i < len(other.spans) else None
            if a != b:  # pages from its first token on differ
                return min(s[0] for s in (a, b) if s is not None)
        return max(len(self.ids), len(other.ids))

    def reach(self, other: _Known, page_size: int) -> int:
        """A cheap guess at how far the two agree: the furthest of pages 1, 2, 4, 8, ... up to
        which the ids of each such page are equal, before any image they do not share (only the
        candidate is chosen by it)."""
        pages = min(len(self.ids), len(other.ids), self.first_unshared_image(other)) // page_size
        reach, page = 0, 1
        while page < pages:
            span = slice(page * page_size, (page + 1) * page_size)
            if self.ids[span] != other.ids[span]:
                break
            reach, page = page, page * 2
        return reach

    def covers(self, other: _Known, page_size: int) -> bool:
        """Whether `other` is a beginning of this prompt (every page of it equal, by their keys
        where both have them): this one then serves whatever it would."""
        n = len(other.ids)
        if n > len(self.ids):
            return False
        pages = n // page_size
        if len(self.keys) >= pages and len(other.keys) >= pages:  # a key hashes all its page depends on
            return self.keys[:pages] == other.keys[:pages]
        if self.first_unshared_image(other) < n or self.ids[n - page_size:n] != other.ids[n - page_size:n]:
            return False  # a cheap first look
        known = self.base[1] if self.base is not None and self.base[0]() is other else 0  # compared at admission
        return self.equal_pages(other, page_size, known) * page_size >= n

    def equal_pages(self, other: _Known, page_size: int, known: int = 0) -> int:
        """How many leading full pages the two have in common (the first `known` are)."""
        pages = min(len(self.ids), len(other.ids)) // page_size
        mine, theirs = self.ids, other.ids  # list comparisons run in C; each slice is compared once
        start = min(known, pages) * page_size
        if mine[start:pages * page_size] != theirs[start:pages * page_size]:
            low, high = start // page_size, pages  # the first `low` pages are equal, the first `high` are not
            while high - low > 1:
                middle = (low + high) // 2
                span = slice(low * page_size, middle * page_size)
                low, high = (middle, high) if mine[span] == theirs[span] else (low, middle)
            pages = low
        end = pages * page_size
        a, b = self.positions[:, start:end], other.positions[:, start:end]
        same = end
        if not np.array_equal(a, b):  # (rarely: ids and images alike, positions not)
            same = start + int(np.flatnonzero((a != b).any(axis=0))[0])
        return min(same, self.first_unshared_image(other)) // page_size
