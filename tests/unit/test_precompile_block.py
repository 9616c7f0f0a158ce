"""`compile_in_parallel`'s bookkeeping, with Triton's async-compile mode and CUDA faked (the GPU
tests run the real thing): launches are recorded once per key and submitted when the block ends,
under the device current at each launch; the compiled kernels are loaded on the pool's threads;
a block whose body raises submits nothing and leaves the launcher clean for the next one."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

from mmpipe.kernels import precompile
from mmpipe.kernels.launch import launch


class _Compiled:
    def __init__(self) -> None:
        self.loaded_on: str | None = None

    def _init_handles(self) -> None:
        self.loaded_on = threading.current_thread().name


class _Future:
    def __init__(self) -> None:
        self.kernel = _Compiled()


class _Mode:
    active: "_Mode | None" = None

    def __init__(self, pool: Any, ignore_errors: bool = False) -> None:
        self.ignore_errors = ignore_errors
        self.future_kernels: dict[Any, _Future] = {}

    def __enter__(self) -> "_Mode":
        _Mode.active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _Mode.active = None


class _Kernel:
    def __init__(self) -> None:
        self.warmups: list[tuple[tuple[Any, ...], dict[str, Any], int]] = []

    def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> None:
        assert _Mode.active is not None  # submitted inside the mode
        self.warmups.append((args, kwargs, _device[0]))
        _Mode.active.future_kernels[(id(self), args, tuple(kwargs.items()))] = _Future()


_device = [0]


@pytest.fixture()
def fake_cuda(monkeypatch):
    @contextlib.contextmanager
    def device(index: int) -> Any:
        saved, _device[0] = _device[0], index
        try:
            yield
        finally:
            _device[0] = saved

    monkeypatch.setattr(precompile, "_async_compile_mode", lambda: _Mode)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: _device[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _device[0] = 0


def test_launches_are_recorded_once_per_key_and_submitted_at_the_end(fake_cuda):
    kernel = _Kernel()
    with precompile.compile_in_parallel() as parallel:
        assert parallel
        for n in (7, 7, 9, 7):  # a kernel launched per layer: keys repeat
            launch(kernel, (1,), n, BLOCK=64)
            assert kernel.warmups == []  # nothing submitted while the block runs
    assert [args for args, _, _ in kernel.warmups] == [(7,), (9,)]
    assert launch.compile_only_thread is None and launch.compile_only_pending == []


def test_each_launch_compiles_under_its_device_and_one_device_loads_on_the_pool(fake_cuda, monkeypatch):
    kernel, loaded = _Kernel(), []
    original = precompile._load_in_parallel

    def spy(pool: Any, kernels: list[Any], device: int) -> None:
        loaded.append((len(kernels), device))
        original(pool, kernels, device)

    monkeypatch.setattr(precompile, "_load_in_parallel", spy)
    with precompile.compile_in_parallel():
        with torch.cuda.device(1):
            launch(kernel, (1,), 3, BLOCK=64)
            launch(kernel, (1,), 4, BLOCK=64)
    assert [device for _, _, device in kernel.warmups] == [1, 1]
    assert loaded == [(2, 1)]
    with precompile.compile_in_parallel():
        launch(kernel, (1,), 5, BLOCK=64)
        with torch.cuda.device(1):
            launch(kernel, (1,), 6, BLOCK=64)
    assert [device for _, _, device in kernel.warmups[2:]] == [0, 1]
    assert loaded == [(2, 1)]  # two devices: each kernel loads at its first real launch


def test_compiled_kernels_load_on_the_pool_threads(fake_cuda, monkeypatch):
    kernel, seen = _Kernel(), []
    original = _Mode.__exit__

    def keep(self: _Mode, *exc: Any) -> None:
        seen.extend(self.future_kernels.values())
        original(self, *exc)

    monkeypatch.setattr(_Mode, "__exit__", keep)
    with precompile.compile_in_parallel():
        launch(kernel, (1,), 1, BLOCK=32)
        launch(kernel, (1,), 2, BLOCK=32)
    assert len(seen) == 2 and all(f.kernel.loaded_on.startswith("mmpipe-triton") for f in seen)


def test_a_body_that_raises_submits_nothing_and_the_next_block_starts_clean(fake_cuda):
    kernel = _Kernel()
    with pytest.raises(RuntimeError, match="broken walk"):
        with precompile.compile_in_parallel():
            launch(kernel, (1,), 1, BLOCK=32)
            raise RuntimeError("broken walk")
    assert kernel.warmups == [] and launch.compile_only_thread is None
    assert launch.compile_only_pending == [] and not launch.compile_only_seen
    with precompile.compile_in_parallel():
        launch(kernel, (1,), 1, BLOCK=32)
    assert [args for args, _, _ in kernel.warmups] == [(1,)]


def test_failed_compilations_are_left_to_the_real_launch(fake_cuda):
    modes: list[_Mode] = []
    original = _Mode.__init__

    def init(self: _Mode, pool: Any, ignore_errors: bool = False) -> None:
        original(self, pool, ignore_errors)
        modes.append(self)

    _Mode.__init__ = init  # type: ignore[method-assign]
    try:
        with precompile.compile_in_parallel():
            pass
    finally:
        _Mode.__init__ = original  # type: ignore[method-assign]
    assert modes and modes[0].ignore_errors
