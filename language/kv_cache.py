"""Paged KV cache: fixed-size pages shared by all sequences, a page table per sequence.

Token i of a sequence lives in page `page_table[i // page_size]` at offset `i % page_size`;
its flat slot is `page * page_size + offset`. Pages are handed out by the engine
(`mmpipe.engine.kv_pages`), which reserves page 0 for padded rows' writes.
"""

from __future__ import annotations

import torch

from mmpipe.step_io import DUMMY_PAGE  # the layout's reserved page (re-exported)


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
    def dummy_slot(self) -> int:
        """The flat slot padded rows write their K/V to: the reserved page's first."""
        return DUMMY_PAGE * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
