"""Where a CUDA graph's memory comes from, behind one interface.

- "arena": a VMM arena; every capture gets fresh addresses on shared physical pages, so many
  captures in any order cost about as much as the largest (`vmm_arena`).
- "shared": one graph memory pool for all captures (what vLLM and SGLang do for the LM; it works
  well when captures go largest first, poorly in arrival order).
- "per_graph": a private pool per capture (PyTorch's default; memory grows with every shape).

`weak_ref` holds a tensor made inside a capture without owning its memory, so its blocks go back
to the pool for later captures while the graph, which keeps the pool, keeps them valid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmpipe.graphs import vmm_arena

log = logging.getLogger("mmpipe")


@dataclass
class CaptureMemory:
    """The memory one capture uses: the pool id for `torch.cuda.graph(pool=...)`, plus whatever
    must live exactly as long as the graph."""

    pool_id: Any
    pool: Any = None
    vrange: Any = None


class GraphMemory(Protocol):
    name: str

    def open(self) -> CaptureMemory: ...

    def capturing(self, memory: CaptureMemory) -> Any: ...

    def release(self, memory: CaptureMemory) -> None: ...

    def physical_bytes(self) -> int | None: ...

    def close(self) -> None:
        """Free the memory itself; every graph using it must be destroyed first."""


class SharedPool:
    name = "shared"

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()

    def open(self) -> CaptureMemory:
        return CaptureMemory(self.handle)

    def capturing(self, memory: CaptureMemory) -> Any:
        return _nothing()

    def release(self, memory: CaptureMemory) -> None:
        return None

    def physical_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        return None  # the pool's blocks go back to the allocator once its graphs are destroyed


class PoolPerGraph(SharedPool):
    name = "per_graph"

    def open(self) -> CaptureMemory:
        return CaptureMemory(torch.cuda.graph_pool_handle())


class ArenaMemory:
    name = "arena"

    def __init__(self, device: torch.device) -> None:
        self.arena = vmm_arena.VmmArena(device)
        self.allocator = vmm_arena.torch_allocator()

    def open(self) -> CaptureMemory:
        vrange = self.arena.open_range()
        pool = torch.cuda.MemPool(self.allocator)
        return CaptureMemory(pool.id, pool=pool, vrange=vrange)

    def capturing(self, memory: CaptureMemory) -> Any:
        return self.arena.allocating_in(memory.vrange)

    def release(self, memory: CaptureMemory) -> None:
        """Call after the graph using `memory` has been destroyed."""
        torch.cuda.synchronize(self.arena.device)
        pool, memory.pool = memory.pool, None
        del pool  # the pool returns its segments to the arena (a bookkeeping no-op)
        self.arena.close_range(memory.vrange)

    def physical_bytes(self) -> int | None:
        return self.arena.physical

    def close(self) -> None:
        self.arena.close()


def device_memory_in_use(device: torch.device | None = None) -> int:
    """Bytes of GPU memory in use (the driver's view: graph pools and VMM pages included), after
    returning the caching allocator's unused blocks. For measurements, not for hot paths. (No
    garbage collection first: tensors are freed by reference counting, and a full collection of a
    process that imported torch and transformers is slow, several times per start-up.)"""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def reserved_bytes(device: torch.device) -> int:
    """The caching allocator's reserved bytes on `device`: `torch.cuda.memory_reserved` without
    flattening every allocator statistic into a dict first (costly on the host, once per capture)."""
    return int(torch.cuda.memory_stats_as_nested_dict(device)["reserved_bytes"]["all"]["current"])


def weak_ref(value: Any) -> Any:
    """A tensor that views `value`'s memory without owning it (non-tensors pass through). Its
    memory stays valid only while something else (a graph's pool) keeps it."""
    if not isinstance(value, torch.Tensor):
        return value
    storage = value.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
    return torch.empty(0, dtype=value.dtype, device=value.device).set_(weak, value.storage_offset(), value.shape,
                                                                       value.stride())


def weak_refs(outputs: Any) -> Any:
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(weak_ref(o) for o in outputs)
    return weak_ref(outputs)


def make_graph_memory(kind: str, device: torch.device) -> GraphMemory:
    if kind == "arena":
        if vmm_arena.available():
            try:
                return ArenaMemory(device)
            except Exception as exc:  # an old driver, a sandbox without VMM, ...
                log.warning("VMM arena unavailable (%s); using one shared graph pool", exc)
        else:
            log.warning("VMM arena unavailable (needs cuda-bindings and torch's custom allocator hook); "
                        "using one shared graph pool")
        return SharedPool()
    if kind == "shared":
        return SharedPool()
    if kind == "per_graph":
        return PoolPerGraph()
    raise ValueError(f"graph memory {kind!r}: use 'arena', 'shared' or 'per_graph'")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
