"""A graph runner compiles its Triton kernels in parallel before capturing only where Triton's
cache is cold: the first key probes, the rest follow only if the probe's kernels were compiled
(seconds each) rather than loaded (milliseconds each)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from mmpipe.graphs import runner as runner_module
from mmpipe.graphs.runner import GraphRunner
from mmpipe.kernels.compile_clock import COLD_COMPILE_SECONDS, TritonCompileClock


class _Clock(TritonCompileClock):
    """Counts as given, hooks nothing; `cold()` is the real rule."""

    def __init__(self, kernels: int, seconds: float, compiled: int | None = None) -> None:
        super().__init__()
        self.kernels, self.seconds, self.compiled = kernels, seconds, compiled

    def __enter__(self) -> "_Clock":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Runner(GraphRunner):
    def __init__(self, lockstep: bool = False, keys: list[int] | None = None) -> None:
        self.passes: list[list[int]] = []
        self.precompiled_keys: set[Any] = set()
        self.lockstep = lockstep
        self.keys = keys or []

    def precompile(self, keys: Any) -> None:
        self.passes.append(list(keys))

    def startup_keys(self) -> list[int]:
        return list(self.keys)


def _fake_compiles(monkeypatch: Any, kernels: int, seconds: float, parallel: bool = True,
                   compiled: int | None = None) -> None:
    @contextlib.contextmanager
    def fake_parallel(workers: int | None = None) -> Any:
        yield parallel

    monkeypatch.setattr(runner_module, "compile_in_parallel", fake_parallel)
    monkeypatch.setattr(runner_module, "TritonCompileClock", lambda: _Clock(kernels, seconds, compiled))


@pytest.mark.parametrize("kernels, seconds, parallel, compiled, expected", [
    (4, 4 * 0.4, True, None, [[256], [128, 64, 1]]),  # no listener; compile time: cold, every key follows
    (4, 4 * 0.004, True, None, [[256]]),  # no listener; load time: the probe only
    (0, 0.0, True, None, [[256]]),  # in memory already
    (4, 4 * 0.4, False, None, []),  # no Triton (or no async compile): nothing
    (4, 4 * 0.4, True, 0, [[256]]),  # the listener saw loads only: warm, however long Triton's set-up took
    (4, 4 * 0.004, True, 1, [[256], [128, 64, 1]]),  # the listener saw a compilation: cold
])
def test_the_first_key_probes_and_the_rest_follow_only_when_cold(monkeypatch, kernels, seconds, parallel, compiled,
                                                                 expected):
    _fake_compiles(monkeypatch, kernels, seconds, parallel, compiled)
    runner = _Runner()
    runner._precompile_if_cold([256, 128, 64, 1])
    assert runner.passes == expected
    assert 0.004 < COLD_COMPILE_SECONDS < 0.4


def test_ranks_in_lockstep_skip_the_timed_pass(monkeypatch):
    """Tensor-parallel ranks run the same forwards in the same order (each holds collectives): a
    pass whose extent depends on each rank's own cache timing is skipped, cold or warm."""
    _fake_compiles(monkeypatch, 4, 4 * 0.4)
    runner = _Runner(lockstep=True)
    runner._precompile_if_cold([256, 128, 64, 1])
    assert runner.passes == []
    ranked = _Runner(lockstep=True, keys=[8, 1])
    assert runner_module.precompile_cold([ranked]) == 0
    assert ranked.passes == []


def test_a_cold_model_compiles_every_runner_and_the_vision_path_in_one_block(monkeypatch):
    """Cold: the first runner's first key probes, then its other keys, every other runner's keys
    and the vision dry run follow in one block; the captures' own probes then skip those keys (a
    key they have not seen, such as a later sampler variant, still probes)."""
    _fake_compiles(monkeypatch, 5, 5 * 0.4)
    prefill, decode, vision = _Runner(keys=[512, 256, 64]), _Runner(keys=[32, 8, 1]), []
    assert runner_module.precompile_cold([prefill, None, decode], lambda: vision.append("ran")) == 10  # probe + block
    assert prefill.passes == [[512], [256, 64]] and decode.passes == [[32, 8, 1]] and vision == ["ran"]
    prefill._precompile_if_cold([512, 256, 64])
    decode._precompile_if_cold([32, 8, 1])
    assert prefill.passes == [[512], [256, 64]] and decode.passes == [[32, 8, 1]]
    decode._precompile_if_cold([33, 32])
    assert decode.passes[-1] == [33]


def test_a_warm_model_runs_the_probe_only(monkeypatch):
    """Warm (the probe's kernels loaded from the disk cache): nothing else, no vision dry run; the
    probed runner does not probe again when it captures, the others probe their own schedules."""
    _fake_compiles(monkeypatch, 5, 5 * 0.004)
    prefill, decode, vision = _Runner(keys=[512, 256, 64]), _Runner(keys=[32, 8, 1]), []
    runner_module.precompile_cold([prefill, decode], lambda: vision.append("ran"))
    assert prefill.passes == [[512]] and decode.passes == [] and vision == []
    decode._precompile_if_cold([32, 8, 1])
    assert decode.passes == [[32]]
    prefill._precompile_if_cold([512, 256, 64])
    assert prefill.passes == [[512]]


def test_a_failing_vision_dry_run_is_logged_and_start_up_goes_on(monkeypatch, caplog):
    _fake_compiles(monkeypatch, 5, 5 * 0.4)
    prefill, decode = _Runner(keys=[512, 256]), _Runner(keys=[8, 1])

    def broken() -> None:
        raise RuntimeError("no memory for the image")

    with caplog.at_level("WARNING", logger="mmpipe"):
        assert runner_module.precompile_cold([prefill, decode], broken) == 10
    assert "no memory for the image" in caplog.text
    assert prefill.passes == [[512], [256]] and decode.passes == [[8, 1]]
    assert decode.precompiled_keys == {8, 1}


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
