"""Host-side metadata for a pack of images run through the ViT in one call.

Everything that depends on image sizes is computed here, on the CPU, outside any graph:
2-D rotary positions, the window permutation (and its inverse), and the segment boundaries
for full-attention blocks (one segment per image frame) and windowed blocks (one per window).
Per-image pieces are cached by grid shape, so packing is a cheap concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from mmpipe.graphs.transfer import to_device

Grid = tuple[int, int, int]


@dataclass
class Segments:
    """Boundaries of independent attention segments over a packed sequence."""

    cu_seqlens: torch.Tensor  # int32 [S+1], on the device
    max_len: int  # host int bounding every segment (for varlen kernels)
    lengths: list[int]  # host copy, for the per-segment reference backend


@dataclass
class VisionPackMeta:
    """Everything the ViT needs about a pack besides the pixels."""

    grids: list[Grid]
    num_patches: int
    patch_order: np.ndarray  # [N] int64: patch index read at each window-ordered position
    merged_inverse: np.ndarray  # [N/unit] int64: window-ordered merged row of each original row
    positions: np.ndarray  # [N, 2] int64 (h, w) per patch, original order
    full_lengths: list[int]  # one per image frame
    window_lengths: list[int]  # one per non-empty window, in patches
    tokens_per_image: list[int]  # merged rows per image

    @property
    def num_merged(self) -> int:
        return int(self.merged_inverse.shape[0])


def build_pack_meta(grids: Sequence[Grid], merge_size: int, window_size: int | None, patch_size: int
                    ) -> VisionPackMeta:
    """The pack's layout. `window_size` None: a tower without windowed blocks (Qwen2-VL, Qwen3-VL):
    patches keep their order (the permutations are identities) and there are no windows."""
    unit = merge_size * merge_size
    window_merged = window_size // merge_size // patch_size if window_size is not None else None
    patch_orders, inverses, positions = [], [], []
    full_lengths: list[int] = []
    window_lengths: list[int] = []
    tokens: list[int] = []
    patch_offset = 0
    for grid in grids:
        t, h, w = (int(v) for v in grid)
        if window_merged is None:
            order, win_lens = _identity_layout(t * h * w), []
        else:
            order, win_lens = _window_layout(t, h, w, merge_size, window_merged)
        merged = t * h * w // unit
        patch_orders.append(order + patch_offset)
        inverses.append(np.argsort(order[::unit] // unit, kind="stable") + patch_offset // unit)
        positions.append(_rotary_positions(t, h, w, merge_size))
        full_lengths.extend([h * w] * t)
        window_lengths.extend(win_lens)
        tokens.append(merged)
        patch_offset += t * h * w
    return VisionPackMeta(
        grids=[tuple(int(v) for v in g) for g in grids],
        num_patches=patch_offset,
        patch_order=np.concatenate(patch_orders) if patch_orders else np.zeros(0, np.int64),
        merged_inverse=np.concatenate(inverses) if inverses else np.zeros(0, np.int64),
        positions=np.concatenate(positions) if positions else np.zeros((0, 2), np.int64),
        full_lengths=full_lengths,
        window_lengths=window_lengths,
        tokens_per_image=tokens,
    )


def cu_seqlens_of(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    return to_device(cu, device)


def segments_of(lengths: Sequence[int], device: torch.device, max_len: int | None = None) -> Segments:
    lengths = [int(n) for n in lengths]
    bound = max(lengths, default=0) if max_len is None else max_len
    return Segments(cu_seqlens_of(lengths, device), bound, lengths)


@lru_cache(maxsize=4096)
def _identity_layout(patches: int) -> np.ndarray:
    order = np.arange(patches, dtype=np.int64)
    order.setflags(write=False)
    return order


@lru_cache(maxsize=4096)
def _window_layout(t: int, h: int, w: int, merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Patch permutation that groups each window's merged units together, and window lengths
    in patches (empty windows dropped). Windows tile the merged grid from the top-left."""
    unit = merge * merge
    gh, gw = h // merge, w // merge
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    nwh, nww = -(-gh // window), -(-gw // window)
    padded = np.full((t, nwh * window, nww * window), -1, dtype=np.int64)
    padded[:, :gh, :gw] = index
    padded = padded.reshape(t, nwh, window, nww, window).transpose(0, 1, 3, 2, 4).reshape(t, nwh * nww, -1)
    counts = (padded >= 0).sum(-1).reshape(-1)
    merged_order = padded.reshape(-1)
    merged_order = merged_order[merged_order >= 0]
    patch_order = (merged_order[:, None] * unit + np.arange(unit)).reshape(-1)
    patch_order.setflags(write=False)
    return patch_order, [int(c) * unit for c in counts if c > 0]


@lru_cache(maxsize=4096)
def _rotary_positions(t: int, h: int, w: int, merge: int) -> np.ndarray:
    """(row, col) of every patch, in merge-block order, repeated over frames."""
    hpos = np.broadcast_to(np.arange(h)[:, None], (h, w))
    wpos = np.broadcast_to(np.arange(w)[None, :], (h, w))
    shape = (h // merge, merge, w // merge, merge)
    hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    out = np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)).astype(np.int64)
    out.setflags(write=False)
    return out
