"""Lazy ViT CUDA graphs and the VMM arena, on the GPU (`pytest -m gpu`)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch
from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
from mmpipe.vision.qwen2_5_vl import Qwen25VisionTransformer, VisionConfig

from mmpipe.graphs.memory import device_memory_in_use
from tests.helpers import random_pack, tower_on_cuda

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SMALL = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=256,
             fullatt_block_indexes=(1, 3), window_size=112)


def make_vit(seed: int = 0, **shape) -> Qwen25VisionTransformer:
    return tower_on_cuda(Qwen25VisionTransformer(VisionConfig(**{**SMALL, **shape})), seed,
                         is_norm=lambda name: "norm" in name or "ln_q" in name)


inputs = random_pack


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def used_bytes() -> int:
    return device_memory_in_use()


@pytest.fixture(scope="module")
def vit():
    return make_vit()


def test_graph_equals_eager_for_single_images(vit):
    runner = ViTGraphRunner(vit, CUDA, default_buckets(4096))
    with torch.inference_mode():
        for i, grid in enumerate([(1, 4, 4), (1, 8, 12), (1, 16, 16), (1, 22, 14), (1, 2, 60), (1, 32, 32),
                                  (1, 46, 30), (1, 64, 64), (1, 10, 6)]):
            pixels, meta = inputs(vit, [grid], seed=i)
            graph, graphed = runner.forward(pixels, meta)
            graph = graph.clone()
            assert graphed
            eager = vit(pixels, meta)
            assert graph.shape == eager.shape
            assert rel(graph, eager) <= 1e-2, grid
    stats = runner.stats()
    assert stats["captures"] >= 6 and stats["eager_fallbacks"] == 0 and stats["eager_runs"] == 0
    runner.close()


def test_same_total_different_boundaries_replayed_alternately(vit):
    """4+6+8 vs 5+5+8 merged rows: the same bucket and graph, different segment boundaries."""
    runner = ViTGraphRunner(vit, CUDA, [72, 128])
    a = [(1, 4, 4), (1, 4, 6), (1, 4, 8)]
    b = [(1, 2, 10), (1, 2, 10), (1, 4, 8)]
    with torch.inference_mode():
        packs = [inputs(vit, a, seed=1), inputs(vit, b, seed=2), inputs(vit, list(reversed(a)), seed=3)]
        eager = [vit(p, m) for p, m in packs]
        for round_ in range(3):
            for (pixels, meta), expected in zip(packs, eager):
                got = runner.forward(pixels, meta)[0].clone()
                assert rel(got, expected) <= 1e-2
    assert runner.stats()["captures"] == 1 and runner.stats()["replays"] == 9
    # The graph really saw different boundaries: a graph frozen to the first layout would differ.
    frozen = runner.forward(*packs[0])[0].clone()
    assert rel(frozen, eager[1]) > 0.1
    runner.close()


def test_packs_with_padding_and_eager_fallbacks(vit):
    runner = ViTGraphRunner(vit, CUDA, [256, 1024], max_images=4)
    with torch.inference_mode():
        pixels, meta = inputs(vit, [(1, 8, 8), (1, 6, 10), (1, 12, 4)], seed=5)  # 172 patches -> bucket 256
        assert rel(runner.forward(pixels, meta)[0].clone(), vit(pixels, meta)) <= 1e-2
        for pack in ([(1, 40, 40)], [(1, 2, 2)] * 5):  # 1600 > largest bucket; more images than slots
            pixels, meta = inputs(vit, pack)
            out, graphed = runner.forward(pixels, meta)
            assert not graphed and torch.equal(out, vit(pixels, meta))  # the runner's own eager fallback
    stats = runner.stats()
    assert stats["eager_fallbacks"] == 2 and stats["eager_runs"] == 2 and stats["graph_runs"] == 1
    runner.close()


def test_arena_keeps_graph_memory_at_the_largest_capture():
    """16 buckets captured in ascending order (the worst order for a caching pool)."""
    vit = make_vit(depth=8, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                   fullatt_block_indexes=(3, 7))
    buckets = [256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288]
    results = {}
    with torch.inference_mode():
        for mode, order in (("arena", buckets), ("arena", buckets[-1:]), ("shared", buckets),
                            ("per_graph", buckets), ("per_graph", buckets[-1:])):
            base = used_bytes()
            runner = ViTGraphRunner(vit, CUDA, buckets, max_graphs=32, memory=mode)
            static = used_bytes() - base
            for bucket in order:
                pixels, meta = inputs(vit, [(1, 2, bucket // 2)])
                assert runner.forward(pixels, meta)[1]
            held = used_bytes() - base - static
            results[(mode, len(order))] = held
            if mode == "arena":
                assert runner.memory.physical_bytes() <= held
            runner.close()
            del runner
            assert used_bytes() - base < 64 << 20  # everything came back
    arena16, alone = results[("arena", 16)], results[("arena", 1)]
    print("\ngraph memory, MiB: " + ", ".join(f"{m} x{n}: {v / 2**20:.0f}" for (m, n), v in results.items()))
    assert arena16 <= 1.1 * alone
    assert results[("shared", 16)] > arena16 and results[("per_graph", 16)] > 3 * arena16


def test_capture_evict_recapture_100_buckets_without_leaks(vit):
    base = used_bytes()
    runner = ViTGraphRunner(vit, CUDA, [64 * k for k in range(1, 101)], max_graphs=6)
    rng = random.Random(0)
    order = list(range(1, 101))
    rng.shuffle(order)
    order += rng.sample(range(1, 101), 40)  # recaptures of evicted buckets
    peak = 0
    with torch.inference_mode():
        for step, k in enumerate(order):
            pixels, meta = inputs(vit, [(1, 2, 32 * k)], seed=step)
            out = runner.forward(pixels, meta)[0]
            if step % 17 == 0:
                assert rel(out.clone(), vit(pixels, meta)) <= 1e-2
            peak = max(peak, runner.memory.physical_bytes())
    live: list[int] = []
    expected = 0
    for k in order:  # least-recently-used with room for 6
        if k in live:
            live.remove(k)
        else:
            expected += 1
            if len(live) == 6:
                live.pop(0)
        live.append(k)
    stats = runner.stats()
    assert stats["captures"] == expected > 100 and stats["evictions"] == expected - 6
    assert stats["graphs"] == 6
    arena = runner.memory.arena
    assert len(arena.ranges) == 6  # evicted captures gave their address ranges back
    del out  # a view of the last graph's output: its range stays reserved while it lives
    runner.close()
    assert arena.physical == 0 and not arena.ranges
    assert used_bytes() - base < 64 << 20


def test_interpreter_exit_with_live_graphs_is_clean():
    script = textwrap.dedent("""
        import torch, sys
        sys.path.insert(0, ".")
        from tests.gpu.test_gpu_vit_graphs import make_vit, inputs
        from mmpipe.vision.graph_runner import ViTGraphRunner
        vit = make_vit()
        runner = ViTGraphRunner(vit, torch.device("cuda"), [64, 128, 256])
        with torch.inference_mode():
            for grid in [(1, 8, 8), (1, 8, 16), (1, 16, 16)]:
                runner.forward(*inputs(vit, [grid]))
        print("captured", runner.stats()["captures"])
        # no close(): graphs, pools and the arena are left to interpreter exit
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "captured 3" in done.stdout


def test_captions_are_identical_with_graphs_on_and_off():
    from mmpipe.app.tiny.eval import TEST_SEED_BASE, mmpipe_captions
    from mmpipe.app.tiny.scenes import make_scene

    from mmpipe import Pipeline

    images = [make_scene(s).image for s in range(TEST_SEED_BASE, TEST_SEED_BASE + 50)]
    from mmpipe import GraphConfig

    # graph_mode "none" means no graphs, unless a runner's own config asks for them.
    on = Pipeline.from_pretrained(device="cuda", dtype="bfloat16", num_kv_pages=4096, graph_mode="none",
                                  vit_graph=GraphConfig(enabled=True, max_graphs=32, memory="arena"))
    off = Pipeline.from_pretrained(device="cuda", dtype="bfloat16", num_kv_pages=4096, graph_mode="none")
    assert not off.runner.vit_runner.enabled and off.stats()["vit"]["graphs"] == 0
    with_graphs = mmpipe_captions(on, images)
    stats = on.stats()["vit"]
    assert stats["captures"] > 0 and stats["replays"] > 0 and stats["graph_runs"] > 0
    assert on.stats()["decode"]["graphs"] == 0 and not on.stats()["prefill"]["enabled"]
    assert with_graphs == mmpipe_captions(off, images)
    on.close()
    off.close()
