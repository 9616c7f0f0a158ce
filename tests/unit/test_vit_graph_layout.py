"""Host-side logic of the ViT graph runner (the GPU parts are in test_gpu_vit_graphs.py): buckets,
segment boundaries with padding, and the segment-slot bound every layout must fit."""

from __future__ import annotations

import random

import numpy as np
import pytest
from mmpipe.vision.graph_runner import _boundaries, default_buckets, full_segment_slots, window_segment_slots
from mmpipe.vision.metadata import build_pack_meta


def test_default_buckets_are_fine_then_coarse():
    buckets = default_buckets(16384)
    assert buckets[:3] == [64, 128, 192] and buckets[-1] == 16384
    steps = np.diff(buckets)
    assert set(steps[:15]) == {64} and 1024 in set(steps)
    assert all(b % 4 == 0 for b in buckets) and buckets == sorted(set(buckets))
    assert default_buckets(1000)[-1] == 1000 and default_buckets(30)[-1] == 32


def test_boundaries_pad_with_empty_segments():
    cu = _boundaries([16, 24, 32, 8], 6)
    assert cu.tolist() == [0, 16, 40, 72, 80, 80, 80]
    with pytest.raises(ValueError):
        _boundaries([1] * 7, 6)


@pytest.mark.parametrize("window_merged", [1, 2, 4])
def test_every_pack_layout_fits_its_bucket(window_merged):
    """Random packs, thin strips and tiny images included: the real windows plus the padding
    chunks never exceed the bucket's slots."""
    rng = random.Random(window_merged)
    unit, max_images = 4, 64
    window_size = window_merged * 2 * 14
    window_patches = window_merged**2 * unit
    for bucket in default_buckets(16384):
        for _ in range(6):
            grids, total = [], 0
            while len(grids) < max_images:
                shape = rng.choice([(1, 2, 2), (1, 2, rng.randrange(2, 80, 2)), (1, rng.randrange(2, 60, 2), 2),
                                    (1, rng.randrange(2, 40, 2), rng.randrange(2, 40, 2))])
                if total + shape[1] * shape[2] > bucket:
                    break
                grids.append(shape)
                total += shape[1] * shape[2]
            if not grids:
                continue
            meta = build_pack_meta(grids, 2, window_size, 14)
            pad = bucket - meta.num_patches
            chunks = -(-pad // window_patches)
            assert len(meta.window_lengths) + chunks <= window_segment_slots(bucket, unit, window_merged, max_images)
            assert len(meta.full_lengths) + 1 <= full_segment_slots(max_images)
            assert max(meta.window_lengths) <= window_patches


def test_padding_rows_never_change_real_rows():
    """The runner's padded layout, run eagerly in float32 with junk in the padding rows, gives
    the real rows exactly what the unpadded forward gives."""
    import torch
    from mmpipe.vision.metadata import segments_of
    from mmpipe.vision.qwen2_5_vl import Qwen25VisionTransformer, VisionConfig

    cfg = VisionConfig(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=32,
                       fullatt_block_indexes=(1,), window_size=56)
    torch.manual_seed(0)
    vit = Qwen25VisionTransformer(cfg).eval()
    grids = [(1, 4, 6), (1, 6, 10), (1, 2, 2)]
    meta = build_pack_meta(grids, 2, cfg.window_size, cfg.patch_size)
    n, bucket, window_patches = meta.num_patches, 256, (cfg.window_size // 14) ** 2
    pixels = torch.randn(n, vit.patch_dim)
    cpu = torch.device("cpu")
    order = torch.from_numpy(meta.patch_order)
    with torch.no_grad():
        reference = vit(pixels, meta)
        hidden = torch.cat([vit.embed(pixels, order), torch.randn(bucket - n, cfg.hidden_size) * 100])
        cos, sin = vit.rotary_tables(torch.from_numpy(meta.positions), order)
        cos = torch.cat([cos, torch.rand(bucket - n, cos.shape[1])])
        sin = torch.cat([sin, torch.rand(bucket - n, sin.shape[1])])
        pad = bucket - n
        chunks = [window_patches] * (pad // window_patches) + ([pad % window_patches] if pad % window_patches else [])
        inverse = torch.cat([torch.from_numpy(meta.merged_inverse), torch.arange(n // 4, bucket // 4)])
        padded = vit.forward_blocks(hidden, cos, sin, segments_of(meta.full_lengths + [pad], cpu),
                                    segments_of(meta.window_lengths + chunks, cpu), inverse)
    assert torch.allclose(padded[: n // 4], reference, atol=1e-5, rtol=1e-5)
