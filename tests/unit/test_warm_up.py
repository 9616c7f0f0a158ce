"""Start-up capture of the ViT graphs a run will use: after `capture_packs` for a run's image
sizes, packs of any number of those images replay without a capture (graph bookkeeping on the
CPU, captures simulated); a size that was not warmed still captures lazily."""

from __future__ import annotations

import numpy as np
import torch
from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
from mmpipe.vision.metadata import build_pack_meta
from mmpipe.vision.preprocess import preprocess_image

from mmpipe.graphs import cache as graph_cache_module
from mmpipe.graphs import runner as graph_runner_module
from tests.helpers import random_image
from tests.unit.test_decode_graphs import FakeGraph, FakeMemory

CPU = torch.device("cpu")


def _runner(pipe, monkeypatch, max_patches: int, max_images: int) -> ViTGraphRunner:
    def fake_capture(body, memory, device, warmups=1, shared=None):
        return FakeGraph("vit"), body(), shared or memory.open()

    monkeypatch.setattr(graph_cache_module, "capture", fake_capture)
    monkeypatch.setattr(graph_runner_module, "can_capture_on", lambda device: True)
    monkeypatch.setattr(graph_runner_module, "capturable", lambda backend: True)
    vit = pipe.model.vision
    return ViTGraphRunner(vit, CPU, default_buckets(max_patches, vit.cfg.merge_unit), max_graphs=64,
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
