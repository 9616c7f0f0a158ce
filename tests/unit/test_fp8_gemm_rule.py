"""Where decode's FP8 products run (`mmpipe.kernels.fp8_gemm.rule`, the choice `pick` makes on a
Hopper GPU in a decode step), checked on the CPU against the sweep of decode row counts on
Hopper GPUs it encodes (docs/performance.md) and against what the kernel can take."""

from __future__ import annotations

import pytest
import torch

from mmpipe.kernels.fp8_gemm import MAX_ROWS, pick, rule
from mmpipe.kernels.launch import cdiv

SHAPES_3B = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008)}
SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


@pytest.mark.parametrize("shapes", [SHAPES_3B, SHAPES_7B])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("block", [False, True])
def test_every_choice_is_a_launchable_tiling(shapes, split, block):
    """Tiles the kernel takes (64-row tiles; BLOCK_K 128, a block-scaled weight's tile), K slices
    of at least 512 columns and none empty, a split only where the caller adds partial sums."""
    for n, k in shapes.values():
        for rows in range(1, MAX_ROWS + 1):
            config = rule(rows, n, k, block, split)
            if config is None:
                continue
            assert config.block_m == 64 and config.block_k in (128, 256) and config.block_n in (64, 128)
            assert config.split_k == 1 or (split and config.split_k in (2, 4))
            assert not block or config.block_k == 128  # a block-scaled step stays in one scale column
            slice_k = cdiv(cdiv(k, config.split_k), config.block_k) * config.block_k
            assert slice_k >= 512 or config.split_k == 1
            assert cdiv(k, slice_k) == config.split_k  # no empty slice


def test_the_sweep_choices():
    """What the sweeps on Hopper GPUs found: o and down split K four ways up to 128 rows, two ways
    above (both well ahead of cuBLASLt; docs/performance.md); qkv stays whole; gate_up (22016 columns; also a tensor-parallel half of it, 11008,
    not swept) and the 7B down projection above 128 rows stay on cuBLASLt, as do 128 x 128
    block-scaled products other than split ones up to 128 rows, and anything above 256 rows."""
    o, down, gate_up, qkv = (SHAPES_3B[name] for name in ("o", "down", "gate_up", "qkv"))
    assert rule(48, *o, False, True).split_k == 4 and rule(48, *o, False, True).block_n == 64
    assert rule(128, *down, False, True).split_k == 4 and rule(128, *down, False, True).block_n == 128
    assert rule(256, *down, False, True).split_k == 2
    assert rule(256, *SHAPES_7B["o"], False, True).split_k == 1  # 112 tiles: programs enough
    assert rule(48, *o, False, False).split_k == 1  # the caller takes no partial sums
    assert all(rule(rows, *gate_up, block, split) is None for rows in (33, 64, 256)
               for block in (False, True) for split in (False, True))
    assert all(rule(rows, 11008, 2048, False, False) is None for rows in (33, 128))  # gate_up at TP 2
    assert rule(256, *qkv, False, False) is not None and rule(256, *SHAPES_7B["qkv"], False, False) is None
    assert rule(192, *SHAPES_7B["down"], False, True) is None and rule(128, *SHAPES_7B["down"], False, True)
    assert rule(257, *o, False, True) is None and rule(0, *o, False, True) is None
    assert rule(128, *down, True, True) is not None and rule(129, *down, True, True) is None
    assert rule(64, *qkv, True, False) is None


def test_pick_is_cublas_off_cuda():
    assert pick(48, 2048, 2048, False, True, torch.device("cpu")) is None


def test_only_the_language_models_decode_steps_count_as_decode_steps():
    """`pick`'s gate: the language model's forward enters `gemv.allowed(is decode)`; the ViT and
    anything else outside such a block is no decode step (the Triton GEMM was not swept there)."""
    from mmpipe.kernels import gemv

    assert not gemv.in_decode_step()
    with gemv.allowed(True):
        assert gemv.in_decode_step()
        with gemv.allowed(False):
            assert not gemv.in_decode_step()
        assert gemv.in_decode_step()
    assert not gemv.in_decode_step()
