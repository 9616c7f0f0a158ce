"""The timeline behind `mmpipe bench caption --timeline`: busy time is a union (overlapping
kernels count once), kernels belong to the engine phase whose GPU range holds them, only the
run's range counts, and the engine's phases really appear in a profiler trace."""

from __future__ import annotations

import pytest
import torch
from mmpipe.app.bench.timeline import Interval, from_trace_events, union_length

from mmpipe import Pipeline, SamplingParams


def x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


EVENTS = [
    x("user_annotation", "mmpipe.run", 0, 1000),
    x("user_annotation", "mmpipe.decode", 80, 30),
    x("user_annotation", "mmpipe.vision", 120, 20),
    x("user_annotation", "mmpipe.wait", 300, 250),
    x("gpu_user_annotation", "mmpipe.decode", 90, 170),
    x("gpu_user_annotation", "mmpipe.vision", 140, 120),  # a second stream, inside the decode range
    x("gpu_user_annotation", "mmpipe.prefill", 590, 120),
    x("kernel", "gemm", 100, 100),  # decode
    x("kernel", "vit_attn", 150, 100),  # vision, overlapping the decode kernel
    x("gpu_memcpy", "DtoH", 600, 100),  # prefill
    x("kernel", "stray", 800, 50),  # no phase
    x("kernel", "before", -500, 100),  # outside the run
]


def test_summary_counts_overlaps_once_and_attributes_phases():
    summary = from_trace_events(EVENTS).summary()
    assert summary["seconds"] == pytest.approx(0.001)
    assert summary["gpu_busy"] == pytest.approx((150 + 100 + 50) / 1000)
    assert summary["gpu_decode"] == pytest.approx(0.1)
    assert summary["gpu_vision"] == pytest.approx(0.1)
    assert summary["gpu_prefill"] == pytest.approx(0.1)
    assert summary["gpu_other"] == pytest.approx(0.05)
    assert summary["host_only_gaps"] == pytest.approx(0.7)
    assert summary["host_wait_s"] == pytest.approx(250e-6) and summary["host_decode_s"] == pytest.approx(30e-6)
    assert summary["kernels"] == 4


def test_top_kernels_group_by_name_within_a_phase():
    events = EVENTS + [x("kernel", "gemm", 590, 5), x("kernel", "norm", 596, 2), x("kernel", "gemm", 705, 3)]
    run = from_trace_events(events)
    assert run.top_kernels("prefill") == [("DtoH", pytest.approx(100e-6), 1), ("gemm", pytest.approx(8e-6), 2),
                                          ("norm", pytest.approx(2e-6), 1)]
    assert run.top_kernels("prefill", count=1) == [("DtoH", pytest.approx(100e-6), 1)]
    assert [k for k, _, _ in run.top_kernels("vision")] == ["vit_attn"]


def test_idle_split_and_busy_profile():
    run = from_trace_events(EVENTS)
    split = run.idle_split()
    # In trace-clock units: the first kernel starts at 100 (idle for 100 before it); the last
    # ViT/prefill kernel ends at 700; after it only the stray kernel (50 long) runs until 1000, so
    # 250 of the tail are idle; 650 - 100 - 250 are left for the middle.
    assert split["idle_start_s"] == pytest.approx(100e-6)
    assert split["idle_tail_s"] == pytest.approx(250e-6)
    assert split["idle_middle_s"] == pytest.approx(700e-6 - 100e-6 - 250e-6)
    profile = run.busy_profile(10)  # bins 100 long
    assert profile["decode"][1] == pytest.approx(1.0) and profile["decode"][0] == 0
    assert profile["vision"][1] == pytest.approx(0.5) and profile["vision"][2] == pytest.approx(0.5)
    assert profile["prefill"][6] == pytest.approx(1.0) and profile["other"][8] == pytest.approx(0.5)


def test_union_length():
    assert union_length([Interval(0, 10), Interval(5, 15), Interval(20, 30), Interval(21, 22)]) == 25
    assert union_length([]) == 0


def test_engine_phases_appear_in_a_profile(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    conv = [{"role": "user", "content": [{"type": "image", "image": _image()}, {"type": "text", "text": "hi"}]}]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("mmpipe.run"):
            pipe.chat(conv, SamplingParams(max_new_tokens=3, ignore_eos=True), progress=False)
    names = {e.name for e in prof.events()}
    assert {"mmpipe.schedule", "mmpipe.vision", "mmpipe.prefill", "mmpipe.decode", "mmpipe.read"} <= names


def _image():
    from tests.helpers import random_image
    return random_image(64, 48, seed=5)


def test_a_kernel_takes_the_phase_of_its_own_stream():
    """The ViT on its own stream: its range overlaps the decode range of the main stream, and a
    main-stream kernel inside both is decode's (the later-starting vision range would claim it)."""
    def on(stream: int, event: dict) -> dict:
        return {**event, "tid": stream}

    events = [x("user_annotation", "mmpipe.run", 0, 1000),
              on(7, x("gpu_user_annotation", "mmpipe.decode", 90, 170)),
              on(30, x("gpu_user_annotation", "mmpipe.vision", 140, 120)),
              on(7, x("kernel", "gemm", 150, 50)),
              on(30, x("kernel", "vit_attn", 150, 100)),
              x("kernel", "no_stream", 200, 10)]  # no stream: the later-starting range, as before
    run = from_trace_events(events)
    assert [(k.kernel, k.name) for k in run.kernels] == [("gemm", "decode"), ("vit_attn", "vision"),
                                                         ("no_stream", "vision")]
