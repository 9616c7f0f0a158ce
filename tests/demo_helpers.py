"""Shared by the demo tests: a demo server on a free port, and an engine slowed to a big model's pace."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from mmpipe.pipeline import default_model_path

SAMPLE_DIR = os.path.join(os.path.dirname(default_model_path()), "images")
EXPECTED = dict(line.rstrip("\n").split("\t") for line in open(os.path.join(SAMPLE_DIR, "captions.tsv")))


def sample(name: str) -> str:
    return os.path.join(SAMPLE_DIR, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StepRecorder:
    """Wraps `pipe.engine.step`: sleeps `delay_s` after each step (the pace of a large model, so
    a test can act mid-answer) and records how many requests ran together."""

    delay_s: float
    max_running: int = 0  # most requests stepped together (running after a step, or finished in it)
    steps: int = 0
    aborts: int = 0  # requests aborted while still running
    _original: Any = field(default=None, repr=False)

    def install(self, pipe: Any) -> "StepRecorder":
        engine = pipe.engine
        step_once, abort_once = engine.step, engine.abort

        def step() -> Any:
            finished = step_once()
            self.max_running = max(self.max_running, len(engine.scheduler.running) + len(finished))
            self.steps += 1
            time.sleep(self.delay_s)
            return finished

        def abort(request: Any) -> None:
            if not request.finished:
                self.aborts += 1
            abort_once(request)

        self._original = (step_once, abort_once)
        engine.step, engine.abort = step, abort
        return self

    @contextlib.contextmanager
    def installed(self, pipe: Any) -> Iterator["StepRecorder"]:
        """Installed for a block, the engine's own step and abort back after it (a shared pipe)."""
        self.install(pipe)
        try:
            yield self
        finally:
            pipe.engine.step, pipe.engine.abort = self._original


def wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
