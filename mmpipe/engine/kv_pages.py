"""KV pages as the engine hands them out, and the prefix cache's index of full pages.

Token i of a sequence lives in page `pages[i // page_size]` at offset `i % page_size`. Page 0
(`DUMMY_PAGE`) is never given to a sequence: padded rows of a batch write their K/V there, so
padding never touches a real sequence.

Prefix caching: a full page whose K/V are computed may be registered under a key (see
`prefix_keys`) and then shared by every request whose sequence starts with the same pages; a
page counts its holders. A registered page nobody holds stays cached, in least-recently-used
order, and still counts as free: `allocate` takes never-cached pages first, then evicts cached
ones oldest first (dropping their keys), so the cache never causes a preemption. Shared pages
are only read: a request writes tokens from its own `num_computed` on, past every shared page.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mmpipe.errors import InputError
from mmpipe.step_io import DUMMY_PAGE


class PageAllocator:
    """Free pages (page 0 never handed out), holder counts, and the cached pages' keys."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise InputError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, DUMMY_PAGE, -1))  # never cached, or evicted
        self._holders = [0] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._unheld: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: never-cached ones and cached ones nobody holds."""
        return len(self._free) + len(self._unheld)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise MemoryError(f"asked for {count} KV pages, {self.num_free} free")
        plain = min(count, len(self._free))
        pages = self._free[len(self._free) - plain:][::-1]
        del self._free[len(self._free) - plain:]
        for _ in range(count - plain):  # the least recently used cached pages, their keys dropped
            page, _ = self._unheld.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.evictions += 1
            pages.append(page)
        for page in pages:
            self._holders[page] = 1
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one hold on each page. Pages are given back last first, so that of a cached chain
        its tail is evicted before its head (a chain is only found from its head)."""
        for page in reversed(pages):
            self._holders[page] -= 1
            if self._holders[page]:
                continue
            if page in self._key_of:
                self._unheld[page] = None
            else:
                self._free.append(page)

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, key: bytes) -> int | None:
        """The cached page registered under `key`, if any (nothing is held or reordered)."""
        return self._page_of.get(key)

    def find(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the leading `keys` that are all cached (`lookup` of each in turn,
        up to the first miss)."""
        found = list(map(self._page_of.get, keys))  # a lookup per key, in C
        try:
            return found[:found.index(None)]
        except ValueError:
            return found

    def unheld(self, pages: Sequence[int]) -> int:
        """How many of `pages` nobody holds."""
        holders = self._holders
        return [holders[page] for page in pages].count(0)

    def hold(self, pages: Sequence[int]) -> None:
        """Take a hold on cached pages found by `lookup` (a page nobody held leaves the LRU)."""
        holders, unheld = self._holders, self._unheld
        for page in pages:
            if not holders[page]:
                del unheld[page]
            holders[page] += 1

    def register(self, page: int, key: bytes) -> bool:
        """Cache a held, fully computed page under `key`; False when the key already has a page
        (the same prefix computed twice at once: this copy stays private) or the page a key."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def clear_cache(self) -> int:
        """Forget every cached page (held ones stay with their holders); the number forgotten."""
        forgotten = len(self._key_of)
        self._free.extend(self._unheld)
        self._unheld.clear()
        self._page_of.clear()
        self._key_of.clear()
        return forgotten

    def cache_stats(self) -> dict[str, int]:
        return {"cached_pages": len(self._key_of), "unheld_pages": len(self._unheld), "evictions": self.evictions}


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
