"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL, computed on the host.

Every token has a (temporal, height, width) position. Text tokens have all three equal and
count up by one. The tokens of an image (t, h, w patches, merged m x m) take the grid
coordinates of their merged patch, offset by the position where the image starts; the text
after an image resumes at that start + max(h, w) / m. Generated tokens continue from the
largest prompt position: position = index + delta, delta = max + 1 - prompt length.

A video is one run of t frame groups (Qwen2-VL, Qwen2.5-VL) whose temporal coordinate is the
group's index times a time interval (1 for Qwen2-VL; for Qwen2.5-VL the checkpoint's
`tokens_per_second` times the seconds one group spans, in float32 and truncated, as transformers
computes it), or one run per group positioned as an image (Qwen3-VL, whose prompt writes each
group's time as text).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmpipe.step_io import VisualRun


def mrope_positions_of_runs(total: int, runs: Sequence[VisualRun], merge_size: int) -> tuple[np.ndarray, int]:
    """Positions [3, total] (int64) of a prompt of `total` tokens whose visual runs (in order, not
    overlapping) are `runs`; every other token is text. Returns the decode delta too."""
    positions = np.empty((3, total), dtype=np.int64)
    cursor = start_pos = 0
    for run in runs:
        if run.start < cursor:
            raise ValueError(f"visual runs overlap or are out of order at token {run.start}")
        positions[:, cursor:run.start] = np.arange(start_pos, start_pos + run.start - cursor)
        start_pos += run.start - cursor
        t, h, w = run.grid
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        if run.start + count > total:
            raise ValueError(f"a visual run of {count} tokens at {run.start} passes the prompt's end ({total})")
        steps = (np.arange(t, dtype=np.float32) * np.float32(run.time_interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(steps, np.arange(gh), np.arange(gw), indexing="ij")
        span = slice(run.start, run.start + count)
        positions[0, span] = tt.reshape(-1) + start_pos
        positions[1, span] = hh.reshape(-1) + start_pos
        positions[2, span] = ww.reshape(-1) + start_pos
        start_pos += max(gh, gw)
        cursor = run.start + count
    positions[:, cursor:] = np.arange(start_pos, start_pos + total - cursor)
    delta = int(positions.max(initial=-1)) + 1 - total
    return positions, delta


def mrope_positions(token_ids: Sequence[int], image_grids: Sequence[tuple[int, int, int]],
                    image_token_id: int, merge_size: int) -> tuple[np.ndarray, int]:
    """Positions [3, L] (int64) of a prompt whose image-token runs are given in order, and the
    decode delta. Raises ValueError if the runs do not match the grids."""
    ids = np.asarray(token_ids, dtype=np.int64)
    image_at = np.flatnonzero(ids == image_token_id)  # runs are found here, not token by token in Python
    runs, used = [], 0
    for index, (t, h, w) in enumerate(image_grids):
        if used >= image_at.shape[0]:
            raise ValueError(f"{len(image_grids)} images but {index} image-token runs in the prompt")
        start = int(image_at[used])
        count = t * (h // merge_size) * (w // merge_size)
        if used + count > image_at.shape[0] or int(image_at[used + count - 1]) != start + count - 1:
            raise ValueError(f"image {index}: expected {count} consecutive image tokens")
        runs.append(VisualRun(start, (t, h, w)))
        used += count
    if used != image_at.shape[0]:
        raise ValueError("more image-token runs in the prompt than images")
    return mrope_positions_of_runs(ids.shape[0], runs, merge_size)
