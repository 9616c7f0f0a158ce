"""Host-side M-RoPE positions against transformers' get_rope_index, and the window layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmpipe.language.mrope import mrope_positions
from mmpipe.vision.metadata import build_pack_meta

IMAGE = 99


def prompt(parts):
    """parts: ints (text run lengths) and (t, h, w) grids -> token ids, grids."""
    ids, grids = [], []
    for part in parts:
        if isinstance(part, int):
            ids += list(range(1, part + 1))
        else:
            t, h, w = part
            grids.append(part)
            ids += [IMAGE] * (t * h * w // 4)
    return ids, grids


@pytest.fixture(scope="module")
def hf_rope(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint).model
    model.config.image_token_id = IMAGE

    def rope(ids, grids):
        input_ids = torch.tensor([ids])
        types = (input_ids == IMAGE).int()
        grid = torch.tensor(grids) if grids else None
        if grid is None:
            pos = torch.arange(len(ids)).expand(3, 1, -1)
            return pos[:, 0].numpy(), 0
        pos, delta = model.get_rope_index(input_ids, types, image_grid_thw=grid)
        return pos[:, 0].numpy(), int(delta[0, 0])

    return rope


@pytest.mark.parametrize("parts", [
    [12],
    [5, (1, 4, 6), 7],
    [(1, 8, 4)],
    [3, (1, 2, 2), 1, (1, 10, 4), 2, (1, 6, 6), 4],
])
def test_positions_match_transformers(hf_rope, parts):
    ids, grids = prompt(parts)
    ours, delta = mrope_positions(ids, grids, IMAGE, 2)
    ref, ref_delta = hf_rope(ids, grids)
    assert np.array_equal(ours, ref)
    assert delta == ref_delta


def test_decode_positions_continue_after_the_image():
    ids, grids = prompt([2, (1, 8, 4), 1])
    positions, delta = mrope_positions(ids, grids, IMAGE, 2)
    # image at 2..: rows 0..3 -> positions 2..5, text resumes at 2 + max(4, 2) = 6
    assert positions[:, -1].tolist() == [6, 6, 6]
    assert delta == 7 - len(ids)
    assert len(ids) + delta == 7  # the decode step feeds generated token i at position i + delta


def test_mismatched_image_runs_are_rejected():
    ids, grids = prompt([2, (1, 4, 4), 2])
    with pytest.raises(ValueError, match="images but"):
        mrope_positions(ids, grids + [(1, 2, 2)], IMAGE, 2)
    with pytest.raises(ValueError, match="expected 8 consecutive"):
        mrope_positions(ids[:-4], [(1, 4, 8)], IMAGE, 2)


def test_window_layout_is_a_permutation_with_inverse():
    grids = [(1, 10, 6), (1, 4, 4), (1, 22, 14)]
    meta = build_pack_meta(grids, merge_size=2, window_size=56, patch_size=14)
    n = sum(t * h * w for t, h, w in grids)
    assert sorted(meta.patch_order.tolist()) == list(range(n))
    merged_order = meta.patch_order[::4] // 4
    assert np.array_equal(merged_order[meta.merged_inverse], np.arange(n // 4))
    assert sum(meta.window_lengths) == n and all(x % 4 == 0 for x in meta.window_lengths)
    assert meta.full_lengths == [60, 16, 308]
    assert meta.tokens_per_image == [15, 4, 77]
