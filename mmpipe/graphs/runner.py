"""The one interface of mmpipe's CUDA graph runners (the ViT, the decode step, the prefill pieces).

A runner holds static input buffers (allocated once at its largest size, outside graph memory),
writes each call's inputs into them, and names a key per call (a size, plus whatever else the
graph bakes in). A subclass supplies:

- `body(key)`: the captured region, a function of no arguments over the static buffers;
- `capture_guard()` (optional): state the warm-up run inside a capture must see;
- `lookup(key)` (optional): a live key that serves `key` (default: `key` itself);
- `capture(key)` (optional): how one key is captured (default: `body(key)` through the cache).

The base class does the rest, the same way for every runner: whether graphs are on is decided
once (asked, CUDA, and the attention backend capturable), `replay`/`run` capture lazily, run the
graph, or fall back to the eager path (failed captures are never retried: `GraphCache`),
`capture_all` captures a start-up schedule largest first with one log line and its memory
measured, `stats()` returns one shape for every runner, `close()` tears down in order.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, Iterable, Sequence

import torch

from mmpipe.graphs.cache import GraphCache, GraphStats, bucket_for
from mmpipe.graphs.capture import capture_session
from mmpipe.graphs.memory import GraphMemory, device_memory_in_use, make_graph_memory
from mmpipe.kernels.compile_clock import TritonCompileClock
from mmpipe.kernels.precompile import compile_in_parallel

log = logging.getLogger("mmpipe")


def can_capture_on(device: torch.device) -> bool:
    """CUDA graphs need a CUDA device (tests on the CPU simulate captures by replacing this)."""
    return device.type == "cuda"


def capturable(backend: Any) -> bool:
    """Whether an attention backend's kernels can be captured in a CUDA graph (the one place this
    is asked: backends declare `graph_safe`)."""
    return bool(getattr(backend, "graph_safe", False))


@dataclass
class RunCounts:
    graph_runs: int = 0  # calls served by a graph
    eager_runs: int = 0  # calls run without one (graphs off, no size fits, capture failed)
    startup_seconds: float = 0.0  # `capture_all`: warming up, compiling and capturing
    startup_memory_bytes: int = 0  # GPU memory the start-up schedule holds (the driver's view)


class GraphRunner:
    """Base class; see the module docstring. `wanted`: the configuration asks for graphs (the
    runner still runs eagerly off CUDA or with a backend that cannot be captured)."""

    def __init__(self, name: str, device: torch.device, sizes: Iterable[int], wanted: bool, backend: Any,
                 memory: GraphMemory | str = "shared", max_graphs: int | None = None) -> None:
        self.name, self.device = name, device
        self.sizes = sorted(set(sizes))
        self._lockstep = False
        self.counts = RunCounts()
        on_cuda = can_capture_on(device)
        self.enabled = wanted and on_cuda and capturable(backend)
        if wanted and on_cuda and not self.enabled:
            log.info("%s graphs off: the %s attention backend cannot be captured; running eagerly", name,
                     getattr(backend, "name", type(backend).__name__))
        self.cache: GraphCache | None = None
        self.precompiled_keys: set[Hashable] = set()  # `precompile_cold` compiled them or found them cached
        if self.enabled:
            if isinstance(memory, str):
                memory = make_graph_memory(memory, device)
            self.cache = GraphCache(name, device, memory, max_graphs)

    # ------------------------------------------------------------------ hooks

    def body(self, key: Hashable) -> Callable[[], Any]:
        raise NotImplementedError

    def capture_guard(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def lookup(self, key: Hashable) -> Hashable | None:
        """A live graph's key that serves `key`, or None."""
        assert self.cache is not None
        return key if key in self.cache else None

    @property
    def lockstep(self) -> bool:
        """Set where several processes must run the same forwards in the same order (tensor
        parallelism: the forwards hold collectives): no start-up precompile pass, whose extent
        depends on each process's timing of its Triton cache, and a capture that fails raises
        (a rank running eagerly would issue other collectives than its peers)."""
        return self._lockstep

    @lockstep.setter
    def lockstep(self, on: bool) -> None:
        self._lockstep = on
        if getattr(self, "cache", None) is not None:
            self.cache.strict = on

    def label(self, key: Hashable) -> str:
        return str(key)

    def capture(self, key: Hashable, quiet: bool = False) -> bool:
        """Capture the graph for `key`; False if that failed (logged once by the cache)."""
        assert self.cache is not None
        with self.capture_guard():
            return self.cache.capture(key, self.body(key), self.label(key), quiet=quiet) is not None

    # ------------------------------------------------------------------ running

    def size_for(self, n: int) -> int | None:
        """The smallest captured size >= n, or None (graphs off, or n above the largest)."""
        return bucket_for(self.sizes, n) if self.enabled else None

    def replay(self, key: Hashable) -> Any | None:
        """Outputs of the graph serving `key` (captured now if there is none), or None when it
        cannot be captured: the caller then runs eagerly. Outputs alias graph memory."""
        assert self.cache is not None
        live = self.lookup(key)
        if live is None:
            if not self.capture(key):
                return None
            live = key
        self.counts.graph_runs += 1
        return self.cache.replay_key(live)

    def run(self, key: Hashable | None, eager: Callable[[], Any]) -> tuple[Any, bool]:
        """(outputs, True) from the graph for `key`, or (eager(), False) when `key` is None
        (no size fits) or its graph cannot be captured."""
        output = self.replay(key) if key is not None and self.cache is not None else None
        if output is not None:
            return output, True
        self.counts.eager_runs += 1
        return eager(), False

    def fallback(self, message: str, *args: Any) -> None:
        """Count and log a call that fits no graph (graphs on; the caller runs it eagerly)."""
        if self.cache is not None:
            self.cache.fallback(message, *args)

    def capture_all(self, keys: Sequence[Hashable], progress: bool = True, what: str = "sizes") -> None:
        """Capture `keys` (largest first: smaller ones reuse the largest one's pool blocks), with a
        progress bar, the time and GPU memory measured, and one log line."""
        if self.cache is None:
            return
        from tqdm import tqdm

        measure = self.device.type == "cuda"
        before = device_memory_in_use(self.device) if measure else 0
        start = time.perf_counter()
        self._precompile_if_cold(keys)
        with capture_session():
            for key in tqdm(keys, desc=f"capturing {self.name} graphs", unit="graph", disable=not progress,
                            leave=False, dynamic_ncols=True):
                self.capture(key, quiet=True)
        self.counts.startup_seconds += time.perf_counter() - start
        after = device_memory_in_use(self.device) if measure else 0
        self.counts.startup_memory_bytes += max(0, after - before)
        failed = [k for k in keys if self.lookup(k) is None]
        log.info("%s graphs: %d %s (%s)%s captured in %.1f s; GPU memory %.0f -> %.0f MiB (graphs %.0f MiB)",
                 self.name, len(keys) - len(failed), what, _ranges(keys), self.startup_note(),
                 self.counts.startup_seconds, before / 2**20, after / 2**20, (after - before) / 2**20)
        if failed:
            log.warning("%s graphs: %d of %d could not be captured and run eagerly: %s", self.name, len(failed),
                        len(keys), [self.label(k) for k in failed])

    def precompile(self, keys: Sequence[Hashable]) -> None:
        """Run what capturing `keys` will run, inside `compile_in_parallel` (Triton kernels compiled
        on a thread pool, not run), so the captures find every kernel compiled. Default: each
        key's body under the capture guard; the body must index nothing by what its Triton kernels
        write (see `mmpipe.kernels.precompile`)."""
        for key in keys:
            with self.capture_guard():
                self.body(key)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _precompile_if_cold(self, keys: Sequence[Hashable]) -> None:
        """On a machine whose Triton cache lacks this runner's kernels, compile them all in parallel
        before the captures. The first key is the probe: its kernels are compiled (or loaded from
        the disk cache) in parallel, and only if they took compile time, not load time, are the
        other keys' kernels compiled too (a warm cache would pay a pass over every key of the
        decode and prefill schedules for nothing). Keys `precompile_cold` did already
        are left out."""
        keys = [k for k in keys if k not in self.precompiled_keys]
        if not keys or self.lockstep:
            return
        parallel, probe = _probe(self, keys[0])
        if parallel and probe.cold() and len(keys) > 1:
            with compile_in_parallel():
                self.precompile(keys[1:])

    def startup_keys(self) -> list[Hashable]:
        """The keys a start-up `capture_all` would capture, largest first ([]: none)."""
        return []

    def startup_note(self) -> str:
        return ""

    # ------------------------------------------------------------------ stats, teardown

    def stats(self) -> dict[str, Any]:
        """One shape for every runner; `detail` holds what only this runner has."""
        cache = (self.cache.stats if self.cache is not None else GraphStats()).as_dict()
        return {"enabled": self.enabled, "sizes": list(self.sizes) if self.enabled else [],
                "graphs": cache.pop("graphs_live"), **cache, **self.counts.__dict__, "detail": self.detail()}

    def detail(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Destroy every graph (outputs first), then the memory behind them. Idempotent."""
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def _ranges(keys: Sequence[Hashable]) -> str:
    sizes = sorted(k[0] if isinstance(k, tuple) else k for k in keys)  # type: ignore[type-var]
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]}"


def precompile_cold(runners: Sequence[GraphRunner], more: Callable[[], None] | None = None) -> int:
    """On a machine whose Triton cache lacks them, compile the start-up schedules' kernels of all
    `runners` (and of `more`, a compile-only-safe forward such as one image through the vision
    encoder) in one parallel block, before any of them captures: one wait for the whole model
    instead of one per runner, and the first image request compiles nothing. The first runner's
    first key is the probe (as `_precompile_if_cold`); with a warm cache nothing more runs and
    the other runners probe their own schedules when they capture. A `more` that fails is logged
    and skipped (its kernels then compile when first used). Returns the kernels compiled or loaded."""
    plans = [(r, r.startup_keys()) for r in runners if r is not None and not r.lockstep]
    plans = [(r, keys) for r, keys in plans if keys]
    if not plans:
        return 0
    first, keys = plans[0]
    parallel, probe = _probe(first, keys[0])
    if not parallel:
        return 0
    if not probe.cold():  # the first runner's cache is warm: its own capture need not probe again
        first.precompiled_keys.update(keys)
        return probe.kernels
    with TritonCompileClock() as clock, compile_in_parallel():
        first.precompile(keys[1:])
        for runner, runner_keys in plans[1:]:
            runner.precompile(runner_keys)
        if more is not None:
            try:
                more()
            except Exception as exc:  # noqa: BLE001 - a best-effort warm-up must not fail start-up
                log.warning("precompiling the vision path failed (its kernels compile at the first image "
                            "request): %s", exc)
    for runner, runner_keys in plans:
        runner.precompiled_keys.update(runner_keys)
    return probe.kernels + clock.kernels


def _probe(runner: GraphRunner, key: Hashable) -> tuple[bool, TritonCompileClock]:
    """Compile the kernels of `runner`'s `key` in parallel (or load them from Triton's disk
    cache): whether Triton compiles in parallel here, and the clock that saw which it was."""
    with TritonCompileClock() as clock:
        with compile_in_parallel() as parallel:
            if parallel:
                runner.precompile([key])
    return parallel, clock
