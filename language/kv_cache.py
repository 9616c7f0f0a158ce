"""Paged KV cache: fixed-size pages shared by all sequences, a page table per sequence.

Token i of a sequence lives in page `page_table[i // page_size]` at offset `i % page_size`;
its flat slot is `page * page_size + offset`. Page 0 is reserved: padded rows of a batch write
their K/V there, so padding never touches a real sequence.
"""

from __future__ import annotations

import torch

from mmpipe.errors import InputError

DUMMY_PAGE = 0


class KVCache:
    """K and V of every layer, each its own [pages, page_size, kv_heads, head_dim] allocation
    (`layers[i] = (k, v)`). Separate allocations, not views of one: a compiler that functionalises
    the in-place KV write (Inductor) must see inputs that do not alias each other, or it rebuilds
    and copies their common base.

    CUDA graphs (decode steps, prefill pieces) bake in the addresses of these pages: the cache is
    allocated once, before any capture, and must never be reallocated or resized while graphs
    that were captured against it live.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)

    def stacked(self) -> torch.Tensor:
        """A copy of the whole cache as [layers, 2, pages, page_size, kv_heads, head_dim] (tests)."""
        return torch.stack([torch.stack(pair) for pair in self.layers])

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


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
