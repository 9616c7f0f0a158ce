"""Start-up capture of the graphs a run will use (graph bookkeeping on the CPU, captures
simulated): after `capture_packs` for a run's image sizes, packs of any number of those images
replay without a capture, and a size that was not warmed still captures lazily; `Pipeline.warm_up`
returns the graphs it added and completes a sampling variant that a request captured in part."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
from mmpipe.vision.metadata import build_pack_meta
from mmpipe.vision.preprocess import preprocess_image

from mmpipe.graphs import cache as graph_cache_module
from mmpipe.graphs import runner as graph_runner_module
from mmpipe import SamplingParams
from tests.helpers import random_image
from tests.unit.test_decode_graphs import FakeGraph, FakeMemory, simulated_graphs  # noqa: F401 (a fixture)

CPU = torch.device("cpu")


def _runner(pipe, monkeypatch, max_patches: int, max_images: int, max_graphs: int = 64) -> ViTGraphRunner:
    def fake_capture(body, memory, device, warmups=1, shared=None):
        return FakeGraph("vit"), body(), shared or memory.open()

    monkeypatch.setattr(graph_cache_module, "capture", fake_capture)
    monkeypatch.setattr(graph_runner_module, "can_capture_on", lambda device: True)
    monkeypatch.setattr(graph_runner_module, "capturable", lambda backend: True)
    vit = pipe.model.vision
    return ViTGraphRunner(vit, CPU, default_buckets(max_patches, vit.cfg.merge_unit), max_graphs=max_graphs,
                          memory=FakeMemory(), max_images=max_images)


def test_packs_of_warmed_sizes_capture_nothing_during_a_run(pipe, monkeypatch):
    max_patches, max_images = 2048, 8
    runner = _runner(pipe, monkeypatch, max_patches, max_images)
    cfg = pipe.model.image_processor
    images = [preprocess_image(random_image(w, h, seed=w), cfg) for w, h in ((112, 112), (200, 140))]
    grids = [im.grid_thw for im in images]
    expected = {runner.key_for(k * im.num_patches, k) for im in images
                for k in range(1, min(max_images, max_patches // im.num_patches) + 1)}
    assert runner.capture_packs(grids + grids, max_patches) == len(expected) > 4
    assert runner.capture_packs(grids, max_patches) == 0  # nothing left to capture
    captures = runner.cache.stats.captures
    vit = pipe.model.vision
    packs = [(image, k) for image in images for k in range(1, min(max_images, max_patches // image.num_patches) + 1)]
    for i in np.random.default_rng(0).permutation(len(packs)):  # a run: every pack count of each size, any order
        image, k = packs[i]
        meta = build_pack_meta([image.grid_thw] * k, vit.cfg.spatial_merge_size, vit.cfg.window_size,
                               vit.cfg.patch_size)
        _, graphed = runner.forward(torch.cat([image.pixel_values] * k), meta)
        assert graphed
    assert runner.cache.stats.captures == captures
    other = preprocess_image(random_image(280, 280, seed=3), cfg)  # not warmed: captured when first met
    meta = build_pack_meta([other.grid_thw], vit.cfg.spatial_merge_size, vit.cfg.window_size, vit.cfg.patch_size)
    assert runner.forward(other.pixel_values, meta)[1] and runner.cache.stats.captures == captures + 1


def test_a_warm_up_keeps_to_the_cache_and_evicts_other_graphs_first(pipe, monkeypatch):
    """Room for 6 graphs, 8 pack shapes wanted: the 6 packs of fewest images are captured, and a
    second warm-up captures nothing (no churn). After two lazy captures evicted two of them, a
    warm-up captures those two again by evicting the lazily captured graphs, not its other ones."""
    runner = _runner(pipe, monkeypatch, 2048, 8, max_graphs=6)
    cfg, vit = pipe.model.image_processor, pipe.model.vision
    small = preprocess_image(random_image(112, 112, seed=1), cfg)
    wanted = [runner.key_for(k * small.num_patches, k) for k in range(1, 7)]
    assert len(set(wanted)) == 6 and runner.key_for(8 * small.num_patches, 8) not in wanted
    assert runner.capture_packs([small.grid_thw], 2048) == 6 and set(runner.cache.live_keys()) == set(wanted)
    assert runner.capture_packs([small.grid_thw], 2048) == 0
    others = []
    for size in ((280, 280), (200, 140)):  # one-image packs of other sizes, captured when met
        image = preprocess_image(random_image(*size, seed=2), cfg)
        meta = build_pack_meta([image.grid_thw], vit.cfg.spatial_merge_size, vit.cfg.window_size, vit.cfg.patch_size)
        assert runner.forward(image.pixel_values, meta)[1]
        others.append(runner.key_for(image.num_patches, 1))
    assert set(others) <= set(runner.cache.live_keys()) and len(set(wanted) & set(runner.cache.live_keys())) == 4
    assert runner.capture_packs([small.grid_thw], 2048) == 2
    assert set(runner.cache.live_keys()) == set(wanted)


# ---------------------------------------------------------------------------- Pipeline.warm_up

def _graphs(pipe) -> tuple[int, int]:
    """(live graphs, captures) of the ViT, prefill and decode runners together."""
    stats = pipe.stats()
    return tuple(sum(stats[name][field] for name in ("vit", "prefill", "decode")) for field in ("graphs", "captures"))


@pytest.fixture
def graphed_pipe(checkpoint, simulated_graphs, monkeypatch):
    """A CPU Pipeline whose ViT and decode graphs are simulated (captures run the body; a decode
    replay runs it again), decode buckets 1, 2 and 4; greedy's are captured at start-up."""
    from mmpipe import GraphConfig, Pipeline

    monkeypatch.setattr(graph_runner_module, "capturable", lambda backend: True)
    return Pipeline.from_pretrained(checkpoint, device="cpu", max_running_requests=4,
                                    decode_graph=GraphConfig(buckets=(1, 2, 4)))


SAMPLED = SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True)
TEXT = [{"role": "user", "content": "tell me about the picture"}]


def test_warm_up_returns_the_graphs_it_added(graphed_pipe):
    """ViT packs of two image sizes and a sampled variant's decode buckets: the count returned is
    what the runners' stats gained, in live graphs and in captures; a second warm-up adds none."""
    live, captures = _graphs(graphed_pipe)
    images = [random_image(112, 112, seed=1), random_image(200, 140, seed=2), "missing.png"]
    captured = graphed_pipe.warm_up(images, SAMPLED)
    stats = graphed_pipe.stats()
    assert stats["vit"]["graphs"] > 0 and stats["decode"]["graphs"] == 3 + 3  # greedy's and the variant's
    assert captured == _graphs(graphed_pipe)[0] - live == _graphs(graphed_pipe)[1] - captures
    assert graphed_pipe.warm_up(images, SAMPLED) == 0 and _graphs(graphed_pipe)[1] - captures == captured


def test_warm_up_completes_a_variant_captured_for_one_bucket(graphed_pipe):
    """One sampled request captures its variant's graph for batch 1 only; `warm_up` with that
    sampling captures the other buckets (and not batch 1 again), so a run of 2 and 4 such
    requests captures nothing."""
    decoder = graphed_pipe.runner.decoder
    graphed_pipe.chat([TEXT], SAMPLED)
    sampled = [key for key in decoder.cache.live_keys() if key[1].random]
    assert [key[0] for key in sampled] == [1]
    live, captures = _graphs(graphed_pipe)
    assert graphed_pipe.warm_up((), SAMPLED) == 2
    assert _graphs(graphed_pipe) == (live + 2, captures + 2)
    assert sorted(key[0] for key in decoder.cache.live_keys() if key[1] == sampled[0][1]) == [1, 2, 4]
    for count in (4, 2, 3):
        outs = graphed_pipe.chat([TEXT] * count, [SAMPLED] * count)
        assert all(len(o.token_ids) == 4 for o in outs)
    stats = graphed_pipe.stats()["decode"]
    assert _graphs(graphed_pipe)[1] == captures + 2 and stats["graph_runs"] > 0 and stats["eager_runs"] == 0
