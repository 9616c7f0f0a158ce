"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL, computed on the host.

Every token has a (temporal, height, width) position. Text tokens have all three equal and
count up by one. The tokens of an image (t, h, w patches, merged m x m) take the grid
coordinates of their merged patch, offset by the position where the image starts; the text
after an image resumes at that start + max(h, w) / m. Generated tokens continue from the
largest prompt position: position = index + delta, delta = max + 1 - prompt length.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def mrope_positions(token_ids: Sequence[int], image_grids: Sequence[tuple[int, int, int]],
                    image_token_id: int, merge_size: int) -> tuple[np.ndarray, int]:
    """Positions [3, L] (int64) of a prompt whose image-token runs are given in order, and the
    decode delta. Raises ValueError if the runs do not match the grids."""
    ids = np.asarray(token_ids, dtype=np.int64)
    total = ids.shape[0]
    positions = np.empty((3, total), dtype=np.int64)
    is_image = ids == image_token_id
    image_at = np.flatnonzero(is_image)  # runs are found here, not token by token in Python
    if image_at.shape[0] == 0:
        if image_grids:
            raise ValueError(f"{len(image_grids)} images but 0 image-token runs in the prompt")
        positions[:] = np.arange(total)
        return positions, 0
    cursor, start_pos, image_index = 0, 0, 0
    while cursor < total:
        if not is_image[cursor]:
            following = np.searchsorted(image_at, cursor)
            run_end = int(image_at[following]) if following < image_at.shape[0] else total
            positions[:, cursor:run_end] = np.arange(start_pos, start_pos + run_end - cursor)
            start_pos += run_end - cursor
            cursor = run_end
            continue
        if image_index >= len(image_grids):
            raise ValueError("more image-token runs in the prompt than images")
        t, h, w = image_grids[image_index]
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        if cursor + count > total or not is_image[cursor:cursor + count].all():
            raise ValueError(f"image {image_index}: expected {count} consecutive image tokens")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[0, cursor:cursor + count] = tt.reshape(-1) + start_pos
        positions[1, cursor:cursor + count] = hh.reshape(-1) + start_pos
        positions[2, cursor:cursor + count] = ww.reshape(-1) + start_pos
        start_pos += max(gh, gw)
        cursor += count
        image_index += 1
    if image_index != len(image_grids):
        raise ValueError(f"{len(image_grids)} images but {image_index} image-token runs in the prompt")
    delta = int(positions.max(initial=-1)) + 1 - total
    return positions, delta
