"""How much time Triton spends compiling (or loading from its disk cache) while a block runs.

Triton calls `knobs.runtime.jit_cache_hook` when a kernel specialisation is not in its in-memory
cache (before compiling it, or loading it from `~/.triton/cache`) and `jit_post_compile_hook`
once it is ready; the time between the two is what a first launch waited for. `TritonCompileClock`
installs both for the duration of a `with` block, chaining any hooks already set (a profiler's),
and counts kernels and seconds. Without Triton it counts nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mmpipe.kernels import triton


class TritonCompileClock:
    def __init__(self) -> None:
        self.kernels = 0
        self.seconds = 0.0
        self._pending: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> "TritonCompileClock":
        knobs = _knobs()
        if knobs is None:
            return self
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        self._saved = (before, after)

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
        self._saved = None


def _knobs() -> Any:
    if triton is None:
        return None
    return getattr(triton, "knobs", None)
