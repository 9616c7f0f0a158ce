"""Start-up on CUDA: the report counts Triton compilations where they happen, and a caption-like
run of equal-sized images captures no graph after `warm_up`, which returns the graphs it added."""

from __future__ import annotations

import pytest
import torch

from mmpipe import GraphConfig, Pipeline, SamplingParams
from mmpipe.kernels import tl, triton
from mmpipe.kernels.compile_clock import TritonCompileClock
from tests.helpers import random_image

pytestmark = pytest.mark.gpu


def test_compile_clock_counts_a_new_kernel_only_inside_its_block(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh cache: a real compilation

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(8, device="cuda")
    with TritonCompileClock() as clock:
        add_one[(1,)](x, 8, BLOCK=8)
    assert clock.kernels == 1 and clock.seconds > 0
    with TritonCompileClock() as again:
        add_one[(1,)](x, 8, BLOCK=8)  # in memory now: nothing compiled
    assert again.kernels == 0 and x.tolist() == [2.0] * 8


def test_a_run_of_warmed_image_sizes_captures_nothing(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cuda", max_running_requests=8,
                                    decode_graph=GraphConfig(buckets=(1, 2, 4, 8)), max_prefill_tokens=2048,
                                    max_vision_patches=4096)
    images = [random_image(160, 120, seed=i) for i in range(24)]
    sampling = SamplingParams(max_new_tokens=6, min_new_tokens=3, temperature=0.7, seed=1)  # two sampler variants
    pipe.caption(images[:1], sampling=sampling)  # one image pack and batch 1 of the variants, captured lazily
    graphs = lambda field: sum(pipe.stats()[name][field] for name in ("vit", "prefill", "decode"))  # noqa: E731
    live, captures = graphs("graphs"), graphs("captures")
    captured = pipe.warm_up(images[:2], sampling)
    assert captured > 0 and "ViT graphs" in pipe.startup_report() and "decode graphs for the sampling" in pipe.startup_report()
    assert captured == graphs("graphs") - live == graphs("captures") - captures  # what it added, nothing twice
    before = {name: pipe.stats()[name]["captures"] for name in ("vit", "prefill", "decode")}
    outputs = pipe.caption(images, sampling=sampling)
    assert all(o is not None for o in outputs)
    stats = pipe.stats()
    assert {name: stats[name]["captures"] for name in before} == before
    assert stats["vit"]["graph_runs"] > 1 and stats["vit"]["eager_runs"] == 0
    pipe.close()


def test_a_first_image_request_imports_no_dynamo(checkpoint):
    """From the import to an image request's answer on CUDA, nothing imports `torch._dynamo`
    (seconds of every process's start): not the model built on the meta device, not the ViT's
    FlashAttention."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        from mmpipe import Pipeline
        from tests.helpers import random_image
        import torch
        from mmpipe.vision.attention import VarlenVisionAttention
        from mmpipe.vision.metadata import segments_of
        pipe = Pipeline.from_pretrained({checkpoint!r}, device="cuda", dtype="bfloat16")
        assert pipe.caption([random_image(200, 300, seed=0)])[0] is not None
        # The tiny tower's heads take the reference attention: FlashAttention's path on its own.
        q = torch.randn(700, 16, 80, device="cuda", dtype=torch.bfloat16)
        VarlenVisionAttention().forward(q, q, q, segments_of([300, 400], torch.device("cuda"), max_len=512))
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo).stdout
    assert out.strip().splitlines()[-1] == "no dynamo"
