"""2-D axial rotary tables for the ViT: cos/sin [N, head_dim] of window-ordered patches.

For patch i (taken in window order) at grid position (h, w): the first quarter of the head dim
rotates with h * inv_freq, the second with w * inv_freq, and the second half repeats the first.
On CUDA one Triton kernel reads the positions through the window order and writes both tables
(into given buffers, e.g. a graph's static inputs); elsewhere it is plain PyTorch. Both compute
in float32 exactly as transformers does.
"""

from __future__ import annotations

import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2


def rotary_tables(positions: torch.Tensor, order: torch.Tensor, inv_freq: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [P, 2] (row, col) int64, order [N] int64 (patch taken at each slot), inv_freq
    [head_dim / 4] float32 -> cos, sin [N, head_dim] float32 (written into `out` if given)."""
    n, quarter = order.shape[0], inv_freq.shape[0]
    if triton is None or not positions.is_cuda:
        freqs = positions.index_select(0, order).float()[..., None] * inv_freq  # [N, 2, dim/4]
        emb = freqs.flatten(1)
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if out is not None:
            out[0].copy_(cos)
            out[1].copy_(sin)
            return out
        return cos, sin
    cos, sin = out if out is not None else (torch.empty(n, 4 * quarter, dtype=torch.float32, device=order.device),
                                            torch.empty(n, 4 * quarter, dtype=torch.float32, device=order.device))
    if n:
        block = 64
        launch(
            _rotary_tables_kernel, (cdiv(n, block),),
            positions, order, inv_freq, cos, sin, n, positions.stride(0), cos.stride(0), sin.stride(0),
            QUARTER=quarter, Q_PAD=next_power_of_2(quarter), BLOCK=block, num_warps=4)
    return cos, sin


if triton is not None:

    @triton.jit
    def _rotary_tables_kernel(pos_ptr, order_ptr, inv_ptr, cos_ptr, sin_ptr, n, stride_p, stride_c, stride_s,
                              QUARTER: tl.constexpr, Q_PAD: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < n
        j = tl.arange(0, Q_PAD)
        jmask = j < QUARTER
        mask = rmask[:, None] & jmask[None, :]
        patch = tl.load(order_ptr + rows, mask=rmask, other=0).to(tl.int64)
        row_pos = tl.load(pos_ptr + patch * stride_p, mask=rmask, other=0).to(tl.float32)
        col_pos = tl.load(pos_ptr + patch * stride_p + 1, mask=rmask, other=0).to(tl.float32)
        inv = tl.load(inv_ptr + j, mask=jmask, other=0.0)
        fh = row_pos[:, None] * inv[None, :]
        fw = col_pos[:, None] * inv[None, :]
        ch, sh, cw, sw = tl.cos(fh), tl.sin(fh), tl.cos(fw), tl.sin(fw)
        c_row = cos_ptr + rows.to(tl.int64)[:, None] * stride_c + j[None, :]
        s_row = sin_ptr + rows.to(tl.int64)[:, None] * stride_s + j[None, :]
        tl.store(c_row, ch, mask=mask)  # [rows | cols | rows | cols], each a quarter
        tl.store(c_row + QUARTER, cw, mask=mask)
        tl.store(c_row + 2 * QUARTER, ch, mask=mask)
        tl.store(c_row + 3 * QUARTER, cw, mask=mask)
        tl.store(s_row, sh, mask=mask)
        tl.store(s_row + QUARTER, sw, mask=mask)
        tl.store(s_row + 2 * QUARTER, sh, mask=mask)
        tl.store(s_row + 3 * QUARTER, sw, mask=mask)
