"""A graph runner compiles its Triton kernels in parallel before capturing only where Triton's
cache is cold: the first key probes, the rest follow only if the probe's kernels were compiled
(seconds each) rather than loaded (milliseconds each)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from mmpipe.graphs import runner as runner_module
from mmpipe.graphs.runner import COLD_COMPILE_SECONDS, GraphRunner


class _Clock:
    def __init__(self, kernels: int, seconds: float) -> None:
        self.kernels, self.seconds = kernels, seconds

    def __enter__(self) -> "_Clock":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Runner(GraphRunner):
    def __init__(self) -> None:
        self.precompiled: list[list[int]] = []

    def precompile(self, keys: Any) -> None:
        self.precompiled.append(list(keys))


@pytest.mark.parametrize("kernels, seconds, parallel, expected", [
    (4, 4 * 0.4, True, [[256], [128, 64, 1]]),  # compiled: cold cache, every key follows
    (4, 4 * 0.004, True, [[256]]),  # loaded from the disk cache: the probe only
    (0, 0.0, True, [[256]]),  # in memory already
    (4, 4 * 0.4, False, []),  # no Triton (or no async compile): nothing
])
def test_the_first_key_probes_and_the_rest_follow_only_when_cold(monkeypatch, kernels, seconds, parallel, expected):
    @contextlib.contextmanager
    def fake_parallel(workers: int | None = None) -> Any:
        yield parallel

    monkeypatch.setattr(runner_module, "compile_in_parallel", fake_parallel)
    monkeypatch.setattr(runner_module, "TritonCompileClock", lambda: _Clock(kernels, seconds))
    runner = _Runner()
    runner._precompile_if_cold([256, 128, 64, 1])
    assert runner.precompiled == expected
    assert 0.004 < COLD_COMPILE_SECONDS < 0.4
