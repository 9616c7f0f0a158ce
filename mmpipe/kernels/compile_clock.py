"""How much time Triton spends compiling (or loading from its disk cache) while a block runs.

Triton calls `knobs.runtime.jit_cache_hook` when a kernel specialisation is not in its in-memory
cache (before compiling it, or loading it from `~/.triton/cache`) and `jit_post_compile_hook`
once it is ready; the time between the two is what a first launch waited for. `TritonCompileClock`
installs both for the duration of a `with` block, chaining any hooks already set (a profiler's),
and counts kernels and seconds; through Triton's compilation listener it also counts those it
compiled rather than loaded from its disk cache (`cold()`). Without Triton it counts nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mmpipe.kernels import triton

# Mean seconds per kernel above which Triton compiled rather than loaded from its disk cache:
# compiling one takes far longer than this, loading one far less (docs/performance.md).
COLD_COMPILE_SECONDS = 0.05


class TritonCompileClock:
    def __init__(self) -> None:
        self.kernels = 0
        self.seconds = 0.0
        # Compilations Triton ran rather than loaded from its disk cache while the block ran, in
        # any thread of the process (None: this Triton has no compilation listener to tell).
        self.compiled: int | None = None
        self._pending: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._saved: tuple[Any, Any] | None = None
        self._saved_listener: Any = None

    def __enter__(self) -> "TritonCompileClock":
        knobs = _knobs()
        if knobs is None:
            return self
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        self._saved = (before, after)
        compilation = getattr(knobs, "compilation", None)
        if compilation is not None and hasattr(compilation, "listener"):
            self.compiled = 0
            listener = self._saved_listener = compilation.listener

            def on_compiled(*args: Any, **kwargs: Any) -> Any:
                if not kwargs.get("cache_hit", True):
                    with self._lock:
                        self.compiled = (self.compiled or 0) + 1
                return listener(*args, **kwargs) if listener is not None else None

            compilation.listener = on_compiled

        def on_miss(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._pending[kwargs.get("key")] = time.perf_counter()
            return before(*args, **kwargs) if before is not None else False  # True would skip the compile

        def on_ready(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                start = self._pending.pop(kwargs.get("key"), None)
                if start is not None:
                    self.kernels += 1
                    self.seconds += time.perf_counter() - start
            return after(*args, **kwargs) if after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_ready
        return self

    def __exit__(self, *exc: Any) -> None:
        knobs = _knobs()
        if knobs is not None and self._saved is not None:
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
            if self.compiled is not None:
                knobs.compilation.listener = self._saved_listener
        self._saved = None
        self._saved_listener = None

    def cold(self) -> bool:
        """Whether Triton compiled in the block (its disk cache lacked a kernel). Without a
        compilation listener: whether the kernels took compile time (seconds each) rather than
        load time; a process's first kernels also pay Triton's one-time set-up (hashing its own
        sources, as long as compiling), which misleads that rule, not the listener."""
        if self.compiled is not None:
            return self.compiled > 0
        return bool(self.kernels) and self.seconds / self.kernels > COLD_COMPILE_SECONDS


def _knobs() -> Any:
    if triton is None:
        return None
    return getattr(triton, "knobs", None)
