"""Resized uint8 images -> the ViT's float patches, on the device, in one kernel.

Images cross to the GPU as the bytes Pillow resized (a 448 px RGB image is 0.6 MB; its float32
patches with the temporal repeat are 4.8 MB). The kernel then does what the host did before, with
the same arithmetic, so the patches are bit-identical to `patchify_reference` (transformers'
order of operations): rescale in float64, round to float32, subtract the mean and divide by the
standard deviation in float32 (IEEE division, `div_rn`), and lay the values out as rows of
[C, T, P, P] in merge-block order, each still image repeated over the T temporal frames.

A video's frame group holds T frames of its own, [T, H, W, C], and is normalised as transformers'
video processors do it (rescale folded into the mean and std: `(u - mean * 255) / (std * 255)` in
float32), so its patches equal theirs bit for bit too.

A pack is one flat uint8 buffer (images [H, W, C] and frame groups [T, H, W, C] back to back) plus
a [images, 6] int64 table: (byte offset, patch rows gh, patch columns gw, first output row, bytes
from one frame to the next (0: a still image), 1 for a video's folded normalisation). One program
writes one patch row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.launch import launch, next_power_of_2


def patchify_reference(image: torch.Tensor, patch: int, temporal: int, merge: int, rescale: float,
                       mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """One uint8 image [H, W, C] or frame group [T, H, W, C] (any device) -> float32 patches
    [gh*gw, C*T*P*P], merge-block order: the host arithmetic (transformers': for an image, float64
    rescale and float32 normalise; for a frame group, the video processors' folded one)."""
    channels = image.shape[-1]
    mean32 = torch.tensor(mean, dtype=torch.float64).to(torch.float32).to(image.device)
    std32 = torch.tensor(std, dtype=torch.float64).to(torch.float32).to(image.device)
    if image.dim() == 4:
        if image.shape[0] != temporal:
            raise ValueError(f"a frame group has {image.shape[0]} frames; the tower takes {temporal}")
        frames = image
        values = (frames.to(torch.float32) - mean32 * (1.0 / rescale)) / (std32 * (1.0 / rescale))
    else:
        scale = torch.full((channels,), rescale, dtype=torch.float64, device=image.device)
        values = (image.to(torch.float64) * scale).to(torch.float32)
        values = ((values - mean32) / std32).unsqueeze(0)
    height, width = image.shape[-3:-1]
    gh, gw = height // patch, width // patch
    x = values.permute(0, 3, 1, 2).reshape(values.shape[0], channels, gh // merge, merge, patch, gw // merge, merge,
                                           patch)
    x = x.permute(2, 5, 3, 6, 1, 0, 4, 7)  # [gh/m, gw/m, m, m, C, T, P, P]
    x = x.expand(*x.shape[:5], temporal, patch, patch)  # a still image repeats over time
    return x.reshape(gh * gw, channels * temporal * patch * patch).contiguous()


def patchify(flat: torch.Tensor, table: torch.Tensor, rows: int, max_rows: int, patch: int, temporal: int,
             merge: int, channels: int, scale: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Patches [rows, C*T*P*P] float32 of a pack on CUDA. `flat`: the images' uint8 bytes back to
    back; `table`: int64 [images, 6] (byte offset, gh, gw, first row, frame stride, folded);
    `max_rows`: the most rows of one image; `scale` float64 [1], `mean`/`std` float32 [2, C] (row
    0: the values the image reference rounds to; row 1: mean and std times 1/rescale, the video
    processors' folded values), all on `flat`'s device."""
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
        offset = tl.load(table_ptr + image * 6)
        gh = tl.load(table_ptr + image * 6 + 1)
        gw = tl.load(table_ptr + image * 6 + 2)
        first = tl.load(table_ptr + image * 6 + 3)
        stride = tl.load(table_ptr + image * 6 + 4)
        folded = tl.load(table_ptr + image * 6 + 5)
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
            row = out_ptr + (first + r) * (C * T * P * P)
            col = c * (T * P * P) + dy * P + dx
            if folded == 0:
                mean = tl.load(mean_ptr + c, mask=mask, other=0.0)
                std = tl.load(std_ptr + c, mask=mask, other=1.0)
                u = tl.load(src_ptr + offset + pixel * C + c, mask=mask, other=0)
                v = (u.to(tl.float64) * tl.load(scale_ptr)).to(tl.float32)
                v = tl.math.div_rn(v - mean, std)
                for t in tl.static_range(T):
                    tl.store(row + col + t * P * P, v, mask=mask)
            else:
                mean = tl.load(mean_ptr + C + c, mask=mask, other=0.0)
                std = tl.load(std_ptr + C + c, mask=mask, other=1.0)
                for t in tl.static_range(T):
                    u = tl.load(src_ptr + offset + t * stride + pixel * C + c, mask=mask, other=0)
                    v = tl.math.div_rn(u.to(tl.float32) - mean, std)
                    tl.store(row + col + t * P * P, v, mask=mask)
