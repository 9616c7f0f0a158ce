"""KV pages as the engine hands them out: a free list over the cache's pages, page 0 reserved.

Token i of a sequence lives in page `pages[i // page_size]` at offset `i % page_size`. Page 0
(`DUMMY_PAGE`) is never given to a sequence: padded rows of a batch write their K/V there, so
padding never touches a real sequence.
"""

from __future__ import annotations

from mmpipe.errors import InputError
from mmpipe.step_io import DUMMY_PAGE



class PageAllocator:
    """Free list of KV pages (page 0 never handed out)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise InputError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, DUMMY_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV pages, {len(self._free)} free")
        pages = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return pages[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
