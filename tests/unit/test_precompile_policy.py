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
    def __init__(self, lockstep: bool = False) -> None:
        self.precompiled: list[list[int]] = []
        self.lockstep = lockstep

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


def test_ranks_in_lockstep_skip_the_timed_pass(monkeypatch):
    """Tensor-parallel ranks run the same forwards in the same order (each holds collectives): a
    pass whose extent depends on each rank's own cache timing is skipped, cold or warm."""
    @contextlib.contextmanager
    def fake_parallel(workers: int | None = None) -> Any:
        yield True

    monkeypatch.setattr(runner_module, "compile_in_parallel", fake_parallel)
    monkeypatch.setattr(runner_module, "TritonCompileClock", lambda: _Clock(4, 4 * 0.4))
    runner = _Runner(lockstep=True)
    runner._precompile_if_cold([256, 128, 64, 1])
    assert runner.precompiled == []


def test_a_tensor_parallel_model_runner_puts_its_language_graphs_in_lockstep(monkeypatch):
    import torch

    from mmpipe.config import EngineConfig
    from mmpipe.engine.model_runner import ModelRunner
    from mmpipe.models import load_model
    from mmpipe.pipeline import default_model_path

    model = load_model(default_model_path(), torch.device("cpu"), torch.float32)
    assert not ModelRunner(model, EngineConfig()).decoder.lockstep
    model.tp = type("OneRank", (), {"agree_min": staticmethod(lambda value, device: value)})()
    runner = ModelRunner(model, EngineConfig())
    assert runner.decoder.lockstep and runner.prefiller.lockstep
