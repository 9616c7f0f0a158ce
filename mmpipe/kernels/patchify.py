"""Resized uint8 images -> the ViT's float patches, on the device, in one kernel.

Images cross to the GPU as the bytes Pillow resized (a 448 px RGB image is 0.6 MB; its float32
patches with the temporal repeat are 4.8 MB). The kernel then does what the host did before, with
the same arithmetic, so the patches are bit-identical to `patchify_reference` (transformers'
order of operations): rescale in float64, round to float32, subtract the mean and divide by the
standard deviation in float32 (IEEE division, `div_rn`), and lay the values out as rows of
[C, T, P, P] in merge-block order, each still image repeated over the T temporal frames.

A pack is one flat uint8 buffer (images [H, W, C] back to back) plus a [images, 4] int64 table:
(byte offset, patch rows gh, patch columns gw, first output row). One program writes one patch row.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.launch import launch, next_power_of_2


def patchify_reference(image: torch.Tensor, patch: int, temporal: int, merge: int, rescale: float,
                       mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """One uint8 image [H, W, C] (any device) -> float32 patches [gh*gw, C*T*P*P], merge-block
    order: the host arithmetic (transformers': float64 rescale, float32 normalise)."""
    channels = image.shape[2]
    scale = torch.full((channels,), rescale, dtype=torch.float64, device=image.device)
    mean32 = torch.tensor(mean, dtype=torch.float64).to(torch.float32).to(image.device)
    std32 = torch.tensor(std, dtype=torch.float64).to(torch.float32).to(image.device)
    values = (image.to(torch.float64) * scale).to(torch.float32)
    values = (values - mean32) / std32
    height, width = image.shape[:2]
    gh, gw = height // patch, width // patch
    x = values.permute(2, 0, 1).reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal, patch, patch)  # a still image repeats over time
    return x.reshape(gh * gw, channels * temporal * patch * patch).contiguous()


def patchify(flat: torch.Tensor, table: torch.Tensor, rows: int, max_rows: int, patch: int, temporal: int,
             merge: int, channels: int, scale: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Patches [rows, C*T*P*P] float32 of a pack on CUDA. `flat`: the images' uint8 bytes back to
    back; `table`: int64 [images, 4] (byte offset, gh, gw, first row); `max_rows`: the most rows
    of one image; `scale` float64 [1], `mean`/`std` float32 [C] (the values the reference rounds
    to), all on `flat`'s device."""
    width = channels * temporal * patch * patch
    out = torch.empty(rows, width, dtype=torch.float32, device=flat.device)
    images = table.shape[0]
    if rows and images:
        launch(_patchify_kernel, (max_rows, images), flat, table, out, scale, mean, std, P=patch, T=temporal,
               M=merge, C=channels, BLOCK=next_power_of_2(channels * patch * patch), num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _patchify_kernel(src_ptr, table_ptr, out_ptr, scale_ptr, mean_ptr, std_ptr, P: tl.constexpr,
                         T: tl.constexpr, M: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        image = tl.program_id(1).to(tl.int64)
        offset = tl.load(table_ptr + image * 4)
        gh = tl.load(table_ptr + image * 4 + 1)
        gw = tl.load(table_ptr + image * 4 + 2)
        first = tl.load(table_ptr + image * 4 + 3)
        if r < gh * gw:
            block, within = r // (M * M), r % (M * M)
            py = (block // (gw // M)) * M + within // M
            px = (block % (gw // M)) * M + within % M
            k = tl.arange(0, BLOCK)  # (c, dy, dx) of the patch, c slowest
            mask = k < C * P * P
            c = k // (P * P)
            dy = (k % (P * P)) // P
            dx = k % P
            pixel = (py * P + dy) * (gw * P) + px * P + dx
            u = tl.load(src_ptr + offset + pixel * C + c, mask=mask, other=0)
            v = (u.to(tl.float64) * tl.load(scale_ptr)).to(tl.float32)
            mean = tl.load(mean_ptr + c, mask=mask, other=0.0)
            std = tl.load(std_ptr + c, mask=mask, other=1.0)
            v = tl.math.div_rn(v - mean, std)
            row = out_ptr + (first + r) * (C * T * P * P)
            col = c * (T * P * P) + dy * P + dx
            for t in tl.static_range(T):
                tl.store(row + col + t * P * P, v, mask=mask)
