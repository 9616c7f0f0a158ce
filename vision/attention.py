"""Bidirectional attention within segments of a packed sequence (images, frames or windows).

`torch` is the reference and the CPU path: scaled_dot_product_attention per run of equal-length
segments, using host-side lengths (not capturable). `varlen` uses FlashAttention shipped inside
PyTorch (the aten varlen forward that `torch.nn.attention.varlen.varlen_attn` wraps), reads
boundaries from a device tensor and so can be captured once and replayed with other boundaries,
as long as `max_len` bounds them; its windows (short segments) run in mmpipe's own kernel
(`mmpipe/kernels/window_attention.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mmpipe.vision.metadata import Segments

from mmpipe.kernels.window_attention import MAX_SHORT_SEGMENT, short_segment_attention
from mmpipe.layers.attention import AttentionBackend, flash_varlen, flash_varlen_available

VisionAttention = AttentionBackend[Segments]


class TorchVisionAttention:
    name = "torch"
    graph_safe = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments,
                out: torch.Tensor | None = None, cache: None = None) -> torch.Tensor:
        """q, k, v: [N, heads, head_dim] -> [N, heads, head_dim]; rows past the last segment are zeros."""
        out = torch.empty_like(q) if out is None else out
        start = 0
        for length, count in _runs(seg.lengths):
            if length == 0:
                continue
            stop = start + length * count
            # Equal-length neighbours attend as one batch: [count, heads, length, dim].
            shape = (count, length, q.shape[1], q.shape[2])
            qs, ks, vs = (x[start:stop].reshape(shape).transpose(1, 2) for x in (q, k, v))
            out[start:stop] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(-1, *q.shape[1:])
            start = stop
        if start < q.shape[0]:  # rows past the last segment belong to no image
            out[start:] = 0
        return out


class VarlenVisionAttention:
    """FlashAttention's varlen kernel; segments bounded by MAX_SHORT_SEGMENT tokens (the
    windows) go to mmpipe's short-segment kernel instead, unless `short_segments` is False."""

    name = "varlen"
    graph_safe = True

    def __init__(self, short_segments: bool = True) -> None:
        self.short_segments = short_segments

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments,
                out: torch.Tensor | None = None, cache: None = None) -> torch.Tensor:
        cu = seg.cu_seqlens
        if self.short_segments and seg.max_len <= MAX_SHORT_SEGMENT:
            return short_segment_attention(q, k, v, cu, seg.max_len, out)
        result = flash_varlen(q, k, v, cu, cu, seg.max_len, seg.max_len)
        if out is not None:
            out.copy_(result)
            return out
        return result


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if not flash_varlen_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def make_vision_attention(backend: str, device: torch.device, dtype: torch.dtype) -> VisionAttention:
    """`auto` picks varlen FlashAttention on a capable GPU with a half dtype, else the reference."""
    if backend in ("auto", "cuda") and varlen_available(device, dtype):
        return VarlenVisionAttention()
    return TorchVisionAttention()
