"""What a Pipeline's start-up spent its time on, measured once, reported in one line.

`Pipeline.from_pretrained` records each phase (weights, tokenizer, KV cache, each graph runner's
start-up schedule, the Triton precompile of a cold machine) and Triton's compile time inside them;
the line is logged at INFO, returned by `Pipeline.startup_report()`, shown by `mmpipe info` and
kept in `Pipeline.stats()["startup"]`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from mmpipe.kernels.compile_clock import TritonCompileClock


@dataclass
class Phase:
    name: str
    seconds: float
    detail: str = ""
    triton_kernels: int = 0
    triton_seconds: float = 0.0


@dataclass
class StartupReport:
    phases: list[Phase] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str, merge: bool = False) -> Iterator[Phase]:
        """Time the block as `name` (with Triton compilations inside it); the caller may set
        `.detail` on the phase it gets. `merge`: add to the phase of that name timed before, if
        any (a graph runner is built, then every runner's kernels are precompiled, then it
        captures)."""
        entry = next((p for p in self.phases if p.name == name), None) if merge else None
        if entry is None:
            entry = Phase(name, 0.0)
            self.phases.append(entry)
        start = time.perf_counter()
        with TritonCompileClock() as clock:
            try:
                yield entry
            finally:
                entry.seconds += time.perf_counter() - start
                entry.triton_kernels += clock.kernels
                entry.triton_seconds += clock.seconds

    @property
    def total_seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def line(self) -> str:
        parts = []
        for p in self.phases:
            text = f"{p.name} {p.seconds:.1f} s"
            notes = [p.detail] if p.detail else []
            if p.triton_kernels:
                notes.append(f"Triton {p.triton_kernels} kernels compiled or loaded in {p.triton_seconds:.1f} s")
            parts.append(text + (f" ({'; '.join(notes)})" if notes else ""))
        return f"start-up {self.total_seconds:.1f} s: " + ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"total_s": self.total_seconds,
                "phases": [{"name": p.name, "seconds": p.seconds, "detail": p.detail,
                            "triton_kernels": p.triton_kernels, "triton_seconds": p.triton_seconds}
                           for p in self.phases]}
