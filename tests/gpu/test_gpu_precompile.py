"""`compile_in_parallel`: launches inside it compile their kernels on a thread pool and run
nothing; the same launches afterwards run, compiling nothing more. And a graph runner's start-up
compiles its kernels that way, so its captures compile none."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.compile_clock import TritonCompileClock
from mmpipe.kernels.launch import launch
from mmpipe.kernels.precompile import compile_in_parallel

pytestmark = pytest.mark.gpu


def test_launches_inside_compile_only_and_run_afterwards_without_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh cache: real compilations

    @triton.jit
    def scale_add(x_ptr, y_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE + 1.0, mask=mask)

    x = torch.randn(1000, device="cuda")
    outputs = [torch.full_like(x, -7.0) for _ in range(4)]
    submits = launch.compile_only_submits
    with TritonCompileClock() as clock, compile_in_parallel() as parallel:
        for scale, y in enumerate(outputs, start=1):
            launch(scale_add, (8,), x, y, 1000, SCALE=scale, BLOCK=128)
    torch.cuda.synchronize()
    assert parallel and launch.compile_only_submits - submits == 4
    assert clock.kernels == 4  # compiled (in the pool) by the end of the block
    assert all(bool((y == -7.0).all()) for y in outputs)  # nothing ran
    with TritonCompileClock() as after:
        for scale, y in enumerate(outputs, start=1):
            launch(scale_add, (8,), x, y, 1000, SCALE=scale, BLOCK=128)
    torch.cuda.synchronize()
    assert after.kernels == 0  # every kernel was compiled already
    for scale, y in enumerate(outputs, start=1):
        torch.testing.assert_close(y, x * scale + 1.0)


def test_a_runner_start_up_compiles_before_it_captures(tmp_path, monkeypatch):
    """The decode runner's start-up on a fresh Triton cache: its kernels are submitted in the
    parallel pass, and its graphs then replay the same tokens as eager decode (the captures ran
    the real kernels)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from mmpipe import Pipeline, SamplingParams

    submits = launch.compile_only_submits
    prompts = ["A photo of a red bus in the city", "Two dogs"]
    params = SamplingParams(max_new_tokens=12)
    with Pipeline.from_pretrained(device="cuda", dtype="float32", startup_progress=False) as graphs:
        assert launch.compile_only_submits > submits
        assert graphs.stats()["decode"]["graphs"] > 0
        got = [o.token_ids for o in graphs.generate(prompts, sampling=params)]
    with Pipeline.from_pretrained(device="cuda", dtype="float32", graph_mode="none",
                                  startup_progress=False) as eager:
        want = [o.token_ids for o in eager.generate(prompts, sampling=params)]
    assert got == want


def test_a_launch_key_is_submitted_once_and_kernels_load_on_the_pool(tmp_path, monkeypatch):
    """Repeated launches with one key (a kernel per layer) submit one compilation; each compiled
    kernel is loaded (module and C launcher) on the pool's threads when the block ends, not by the
    first real launch on the caller's thread."""
    import threading

    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    @triton.jit
    def shift(x_ptr, y_ptr, n, BY: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + BY, mask=mask)

    loads: list[str] = []
    monkeypatch.setattr(knobs.runtime, "kernel_load_start_hook",
                        lambda *args, **kwargs: loads.append(threading.current_thread().name))
    x = torch.randn(1000, device="cuda")
    y = torch.zeros_like(x)
    submits = launch.compile_only_submits
    with compile_in_parallel() as parallel:
        for by in (1, 2, 1, 2, 1):
            launch(shift, (8,), x, y, 1000, BY=by, BLOCK=128)
    assert parallel and launch.compile_only_submits - submits == 2
    assert len(loads) == 2 and all(name.startswith("mmpipe-triton") for name in loads), loads
    launch(shift, (8,), x, y, 1000, BY=2, BLOCK=128)
    torch.cuda.synchronize()
    assert len(loads) == 2  # the real launch found it loaded
    torch.testing.assert_close(y, x + 2)


def test_a_cold_start_up_compiles_the_first_image_requests_vision_kernels(tmp_path):
    """A new process on a fresh Triton cache (a new process: Triton's in-memory caches would
    otherwise hold what earlier tests compiled): `from_pretrained` compiles the vision path's
    kernels with the language model's (one image dry run in the parallel block), the first image
    request compiles none of them, and its answer equals a second Pipeline's, built on the now
    warm cache."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json
        from triton import knobs
        from mmpipe import Pipeline, SamplingParams
        from mmpipe.kernels.launch import launch
        from tests.helpers import random_image

        compiled = []

        def record(*args, **kwargs):
            fn = kwargs.get("fn")
            compiled.append(f"{getattr(fn, 'module', '')}.{getattr(fn, 'name', fn)}")
            return False

        knobs.runtime.jit_cache_hook = record
        conversation = [{"role": "user", "content": [{"type": "image", "image": random_image(448, 448, seed=5)},
                                                     {"type": "text", "text": "Describe this image."}]}]
        params = SamplingParams(max_new_tokens=8)
        with Pipeline.from_pretrained(device="cuda", startup_progress=False) as pipe:
            submits, at_start = launch.compile_only_submits, len(compiled)
            first = pipe.chat([conversation], params)[0].token_ids
            during = compiled[at_start:]
        knobs.runtime.jit_cache_hook = None
        with Pipeline.from_pretrained(device="cuda", startup_progress=False) as warm:
            again = warm.chat([conversation], params)[0].token_ids
        print(json.dumps({"start": compiled[:at_start], "during": during, "submits": submits,
                          "same": first == again}))
    """)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), MMPIPE_CACHE_DIR=str(tmp_path / "mmpipe"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo,
                         env=env).stdout
    got = json.loads(out.strip().splitlines()[-1])

    def vision(names: list[str]) -> list[str]:
        return [n for n in names if any(part in n for part in ("patchify", "vision_rotary", "window_attention",
                                                                "_rotary_qk_kernel", "_add_layer_norm_kernel"))]

    assert got["submits"] > 0  # the cold pass ran
    assert vision(got["start"]), got["start"]  # the dry run compiled the vision kernels at start-up
    assert not vision(got["during"]), got["during"]
    assert got["same"]


def test_the_clock_tells_a_compilation_from_a_disk_cache_load(tmp_path, monkeypatch):
    """`TritonCompileClock.cold()` (the precompile probe's rule) from Triton's listener: the same
    kernel defined again misses the in-memory cache but loads from the disk cache, which is warm."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    def define() -> Any:
        @triton.jit
        def plus_one(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)
        return plus_one

    x = torch.zeros(100, device="cuda")
    with TritonCompileClock() as first:
        define()[(1,)](x, 100, BLOCK=128)
    with TritonCompileClock() as second:
        define()[(1,)](x, 100, BLOCK=128)
    torch.cuda.synchronize()
    assert (first.kernels, first.compiled, first.cold()) == (1, 1, True)
    assert (second.kernels, second.compiled, second.cold()) == (1, 0, False)
    torch.testing.assert_close(x, torch.full_like(x, 2.0))
