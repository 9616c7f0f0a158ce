"""The graph cache every CUDA graph runner uses (ViT, decode, prefill pieces).

A runner (`mmpipe.graphs.runner.GraphRunner`) owns its static input buffers. Per call it picks a
key (the bucket, plus whatever else the graph bakes in, such as the sampler variant), fills the
buffers, and hands the cache a body: a function of no arguments that computes the outputs from the
static buffers. The cache does the rest, the same way for every runner:

- capture on first use (warm-up on the capture stream, garbage collection paused, cuBLAS
  workspaces cleared), and on any failure (out of memory, an op that cannot be captured) one log
  line and eager runs for that key from then on, never an error;
- replay, with least-recently-used eviction beyond `max_graphs`;
- teardown in the only safe order: outputs, then the graph, then its memory, then the memory
  itself; also at interpreter exit, where garbage collection would not keep that order;
- statistics: graphs live, captures, capture seconds, replays, eager fallbacks, evictions, bytes.

Aliasing rule. All graphs of one cache draw from one `GraphMemory`. In a shared pool or the VMM
arena, graphs reuse each other's intermediate and output memory, so a graph's outputs are valid
only until the next replay of any graph of the same memory: the caller consumes (copies out, or
reads to the host) the outputs first. Captures that share one `CaptureMemory` (the pieces of one
prefill size) must also be replayed in the order they were captured. Static inputs live outside
graph memory, allocated once at the largest size.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from mmpipe.graphs.capture import capture
from mmpipe.graphs.memory import CaptureMemory, GraphMemory, reserved_bytes

log = logging.getLogger("mmpipe")


def bucket_for(buckets: Sequence[int], size: int) -> int | None:
    """The smallest bucket >= size (buckets sorted ascending), or None above the largest."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


@dataclass
class GraphStats:
    graphs_live: int = 0
    captures: int = 0
    capture_seconds: float = 0.0
    replays: int = 0
    eager_fallbacks: int = 0
    capture_failures: int = 0
    evictions: int = 0
    memory_bytes: int = 0  # physical bytes for the VMM arena; pool growth during captures otherwise

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class CapturedGraph:
    key: Hashable
    graph: torch.cuda.CUDAGraph
    output: Any
    memory: CaptureMemory
    owns_memory: bool = True
    replays: int = 0


class GraphCache:
    def __init__(self, name: str, device: torch.device, memory: GraphMemory, max_graphs: int | None = None,
                 owns_memory: bool = True) -> None:
        """`owns_memory`: `close` closes the memory too (False: another cache's, or its maker's)."""
        self.name, self.device, self.memory = name, device, memory
        self.owns_memory = owns_memory
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[Hashable, CapturedGraph] = OrderedDict()
        self.failed: set[Hashable] = set()  # keys whose capture failed: they run eagerly from then on
        # Set for processes in lockstep (tensor parallelism): a failed capture raises instead of
        # falling back, since a rank running eagerly would issue other collectives than its peers.
        self.strict = False
        self.stats = GraphStats()
        self.closed = False
        _live_caches.add(self)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def replay_key(self, key: Hashable) -> Any:
        """Replay the live graph for `key` and return its outputs."""
        entry = self.graphs[key]
        self.graphs.move_to_end(key)
        self.replay(entry)
        return entry.output

    def touch(self, key: Hashable) -> None:
        """Mark `key`'s graph, if live, as the most recently used (last to be evicted)."""
        if key in self.graphs:
            self.graphs.move_to_end(key)

    def replay(self, entry: CapturedGraph) -> None:
        entry.graph.replay()
        entry.replays += 1
        self.stats.replays += 1

    def capture(self, key: Hashable, body: Callable[[], Any], label: str, warmups: int = 1,
                shared: CaptureMemory | None = None, quiet: bool = False) -> CapturedGraph | None:
        """Capture `body` under `key`; None (with a warning, once) if that fails. `shared`: capture
        into that memory instead of a new one (it stays owned by whoever opened it). `quiet`: log
        at debug level (captures at start-up, summarised by the caller)."""
        if self.closed:
            raise RuntimeError(f"{self.name} graph cache is closed")
        if key in self.failed:  # failed before: never retried (each try costs a warm-up and a sync)
            self.stats.eager_fallbacks += 1
            return None
        while self.max_graphs is not None and len(self.graphs) >= self.max_graphs:
            self._evict()
        on_cuda = self.device.type == "cuda"
        reserved = reserved_bytes(self.device) if on_cuda else 0
        start = time.perf_counter()
        try:
            graph, output, mem = capture(body, self.memory, self.device, warmups=warmups, shared=shared)
        except Exception as exc:  # out of memory, an op that cannot be captured, ...
            if self.strict:
                raise RuntimeError(f"{self.name} graph capture for {label} failed in lockstep with other ranks "
                                   f"({type(exc).__name__}: {exc})") from exc
            self.stats.capture_failures += 1
            self.stats.eager_fallbacks += 1
            self.failed.add(key)
            log.warning("%s graph capture for %s failed (%s: %s); running eagerly", self.name, label,
                        type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            if on_cuda:
                torch.cuda.synchronize(self.device)
            return None
        seconds = time.perf_counter() - start
        entry = self.add(key, graph, output, mem, owns_memory=shared is None)
        self.stats.capture_seconds += seconds
        physical = self.memory.physical_bytes()
        if physical is not None:
            self.stats.memory_bytes = physical
        elif on_cuda:
            self.stats.memory_bytes += max(0, reserved_bytes(self.device) - reserved)
        held = f"{self.stats.memory_bytes / 2**20:.0f} MiB" + (" (arena)" if physical is not None else "")
        log.log(logging.DEBUG if quiet else logging.INFO, "%s graph captured: %s in %.3f s, %s", self.name, label,
                seconds, held)
        return entry

    def add(self, key: Hashable, graph: Any, output: Any, memory: CaptureMemory,
            owns_memory: bool = True) -> CapturedGraph:
        """Keep a graph captured elsewhere (a piece of `split_capture.SplitGraphs`) under `key`;
        the caller accounts its capture time and memory."""
        entry = CapturedGraph(key, graph, output, memory, owns_memory=owns_memory)
        replaced = self.graphs.pop(key, None)
        if replaced is not None:  # a second capture of a live key: the first graph goes, not leaks
            self._destroy(replaced)
        self.graphs[key] = entry
        self.stats.captures += 1
        self.stats.graphs_live = len(self.graphs)
        return entry

    def discard(self, key: Hashable) -> None:
        """Destroy the graph under `key`, if any (a group whose capture failed part-way)."""
        entry = self.graphs.pop(key, None)
        if entry is not None:
            self._destroy(entry)
            self.stats.graphs_live = len(self.graphs)

    def mark_failed(self, key: Hashable) -> None:
        """Record that `key` (e.g. a group of captures sharing one memory, such as a prefill size's
        pieces) could not be captured: it runs eagerly from now on."""
        self.failed.add(key)

    def live_keys(self) -> list[Hashable]:
        return list(self.graphs)

    def fallback(self, message: str, *args: Any) -> None:
        """Count (and log) a call that runs eagerly because it does not fit any graph."""
        self.stats.eager_fallbacks += 1
        log.info(message, *args)

    def _evict(self) -> None:
        key, entry = self.graphs.popitem(last=False)
        self._destroy(entry)
        self.stats.evictions += 1
        self.stats.graphs_live = len(self.graphs)
        log.info("%s graph %s evicted (least recently used)", self.name, key)

    def _destroy(self, entry: CapturedGraph) -> None:
        entry.output = None
        entry.graph.reset()  # graphs go before their memory
        if entry.owns_memory:
            self.memory.release(entry.memory)

    def close(self) -> None:
        """Destroy every graph (outputs first), then the memory behind them. Idempotent."""
        if self.closed:
            return
        while self.graphs:
            self._destroy(self.graphs.popitem(last=False)[1])
        self.stats.graphs_live = 0
        if self.owns_memory:
            self.memory.close()
        self.closed = True


_live_caches: "weakref.WeakSet[GraphCache]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for cache in list(_live_caches):
        try:
            cache.close()
        except Exception:  # the CUDA context may already be gone; nothing left to protect
            pass
