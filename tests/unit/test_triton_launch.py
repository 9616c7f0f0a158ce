"""The direct Triton launcher (`mmpipe.kernels.launch`): which calls take Triton's own path
and what the direct path hands the compiled kernel's launcher. CPU: a stand-in for a JIT kernel
records both paths; the GPU tests compare real kernels launched both ways."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from mmpipe.kernels import launch as triton_launch
from mmpipe.kernels.launch import DirectLauncher, cdiv, next_power_of_2


@dataclass
class Param:
    name: str
    is_constexpr: bool


@dataclass
class FakeCompiled:
    function: str = "function-handle"
    packed_metadata: str = "packed"
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def run(self, *args: Any) -> None:
        self.calls.append(args)


class FakeKernel:
    """A JIT kernel with signature (x, y, n, scale, BLOCK: constexpr, MODE: constexpr)."""

    def __init__(self) -> None:
        self.params = [Param("x", False), Param("y", False), Param("n", False), Param("scale", False),
                       Param("BLOCK", True), Param("MODE", True)]
        self.arg_names = [p.name for p in self.params]
        self.triton_calls: list[tuple[Any, ...]] = []
        self.compiled: list[FakeCompiled] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def call(*args: Any, **kwargs: Any) -> FakeCompiled:
            self.triton_calls.append((grid, args, kwargs))
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]
        return call


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> DirectLauncher:
    monkeypatch.setattr(triton_launch, "_device_of", lambda t: 0)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(triton_launch, "_raw_stream", lambda device: 1234)
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    out = DirectLauncher()
    out.enabled = True
    return out


def test_second_call_launches_the_compiled_kernel_directly(launcher: DirectLauncher) -> None:
    kernel = FakeKernel()
    x, y = torch.zeros(8), torch.ones(8)
    launcher(kernel, (3,), x, y, 16, 0.5, BLOCK=64, MODE="a", num_warps=4)
    assert len(kernel.triton_calls) == 1 and kernel.triton_calls[0][0] == (3,)
    # Same key (the float's value is not part of it), other grid: the direct path, constexprs in
    # signature order after the runtime arguments, the grid padded to three dimensions.
    launcher(kernel, (5, 2), x, y, 16, 0.25, BLOCK=64, MODE="a", num_warps=4)
    assert len(kernel.triton_calls) == 1
    (call,) = kernel.compiled[0].calls
    assert call[:9] == (5, 2, 1, 1234, "function-handle", "packed", None, None, None)
    assert call[9:] == (x, y, 16, 0.25, 64, "a")
    assert (launcher.triton_launches, launcher.direct_launches) == (1, 1)


@pytest.mark.parametrize("change", ["int value", "dtype", "alignment", "constexpr", "option"])
def test_a_different_specialisation_goes_through_triton(launcher: DirectLauncher, change: str) -> None:
    kernel = FakeKernel()
    base = torch.zeros(64, dtype=torch.float16)
    args: dict[str, Any] = {"x": base, "n": 16, "BLOCK": 64, "num_warps": 4}
    launcher(kernel, (1,), args["x"], base, args["n"], 1.0, BLOCK=args["BLOCK"], MODE="a", num_warps=args["num_warps"])
    if change == "int value":
        args["n"] = 32  # Triton specialises ints (== 1, divisible by 16): any other value may differ
    elif change == "dtype":
        args["x"] = torch.zeros(64, dtype=torch.float32)
    elif change == "alignment":
        args["x"] = base[1:]  # 2 bytes past a 16-byte boundary
    elif change == "constexpr":
        args["BLOCK"] = 128
    else:
        args["num_warps"] = 8
    launcher(kernel, (1,), args["x"], base, args["n"], 1.0, BLOCK=args["BLOCK"], MODE="a", num_warps=args["num_warps"])
    assert len(kernel.triton_calls) == 2 and not kernel.compiled[0].calls
    launcher(kernel, (1,), args["x"], base, args["n"], 1.0, BLOCK=args["BLOCK"], MODE="a", num_warps=args["num_warps"])
    assert len(kernel.compiled[1].calls) == 1  # the new key is cached in turn


def test_runtime_values_passed_by_keyword_are_never_replayed(launcher: DirectLauncher) -> None:
    kernel = FakeKernel()
    x = torch.zeros(8)
    for y in (torch.zeros(8), torch.ones(8)):
        launcher(kernel, (1,), x, y=y, n=16, scale=1.0, BLOCK=64, MODE="a")
    assert len(kernel.triton_calls) == 2 and kernel.triton_calls[1][2]["y"] is not kernel.triton_calls[0][2]["y"]


def test_constexprs_are_keyed_with_their_type_and_must_all_be_given(launcher: DirectLauncher) -> None:
    """True, 1 and 1.0 compile differently in Triton; a constexpr left to its default is not in
    the call's keywords, so its value cannot be replayed: never cached (and no error)."""
    kernel = FakeKernel()
    x = torch.zeros(8)
    for block in (1, True, 1, True):
        launcher(kernel, (1,), x, x, 16, 1.0, BLOCK=block, MODE="a")
    assert len(kernel.triton_calls) == 2 and launcher.direct_launches == 2
    assert kernel.compiled[0].calls[0][-2] == 1 and kernel.compiled[1].calls[0][-2] is True
    for _ in range(2):
        launcher(kernel, (1,), x, x, 16, 1.0, BLOCK=64)  # MODE left to a default
    assert len(kernel.triton_calls) == 4


def test_tensors_off_cuda_are_never_cached() -> None:
    assert triton_launch._device_of(torch.zeros(1)) == -1


def test_hooks_or_the_switch_send_every_call_through_triton(launcher: DirectLauncher,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = FakeKernel()
    x = torch.zeros(8)
    launcher.enabled = False
    for _ in range(2):
        launcher(kernel, (1,), x, x, 16, 1.0, BLOCK=64, MODE="a")
    launcher.enabled = True
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: True)  # e.g. a profiler's launch hooks
    for _ in range(2):
        launcher(kernel, (1,), x, x, 16, 1.0, BLOCK=64, MODE="a")
    assert len(kernel.triton_calls) == 4 and launcher.direct_launches == 0


def test_host_helpers_match_triton_semantics() -> None:
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 64, 65, 80)] == [0, 1, 2, 4, 64, 128, 128]


# ---------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_launches_equal_triton_launches_eagerly_and_in_a_graph(dtype: torch.dtype) -> None:
    """Extend attention (many runtime arguments and constexprs) launched by Triton and directly:
    bit-identical outputs, also from a direct launch captured in a CUDA graph and replayed on
    new inputs."""
    from mmpipe.language.attention.cuda_backend import CudaLMAttention

    from tests.attention_helpers import paged_setup

    launcher = triton_launch.launch
    q, k, v, kc, vc, meta = paged_setup([(0, 37), (19, 64), (5, 1)], 16, 8, 2, 128, dtype, seed=11)
    backend = CudaLMAttention(128 ** -0.5, extend="triton")

    def run() -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        return backend.forward(q, k, v, meta, out, (kc, vc))

    launcher.enabled = False
    try:
        reference = run()
    finally:
        launcher.enabled = True
    run()  # compiles or finds the kernel; caches the entry
    before = launcher.direct_launches
    direct = run()
    assert launcher.direct_launches == before + 1
    assert torch.equal(direct, reference)

    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        backend.forward(q, k, v, meta, out, (kc, vc))
    q.copy_(torch.randn_like(q))
    graph.replay()
    launcher.enabled = False
    try:
        expected = run()
    finally:
        launcher.enabled = True
    assert torch.equal(out, expected)


def test_hooks_count_only_when_installed() -> None:
    """Triton 3.6 keeps launch hooks as chains that are never None: an empty chain is no hook."""
    class Chain:
        def __init__(self, calls: list[Any]) -> None:
            self.calls = calls

    assert not triton_launch._active(None)
    assert not triton_launch._active(Chain([]))
    assert triton_launch._active(Chain([print]))
    assert triton_launch._active(print)  # older Triton: a plain function or None
