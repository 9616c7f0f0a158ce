"""Pieces the Qwen vision towers share: the self-attention with 2-D rotary, the rotary tables,
the LayerNorm block with a plain MLP (Qwen2-VL, Qwen3-VL), the LayerNorm patch merger, and the
eager encode of a pack (the graph runner's fallback and the reference for its graphs).

Every tower splits its forward the same way, so one graph runner serves all of them:
`embed(pixels, order, meta, out)` and `rotary_tables(positions, order, out)` run outside the
graph and write its static inputs; `forward_blocks(hidden, cos, sin, full, windows, inverse)` is
the captured region (blocks and mergers; nothing in it depends on host values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from mmpipe.vision.attention import VisionAttention
from mmpipe.vision.metadata import Segments, VisionPackMeta, segments_of
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.graphs.transfer import to_device
from mmpipe.kernels.fused import add_layer_norm, rotary_qk
from mmpipe.kernels.vision_rotary import rotary_tables
from mmpipe.layers.buffers import on_ambient_device
from mmpipe.layers.fp8 import Fp8Rows
from mmpipe.layers.mlp import activation
from mmpipe.layers.parallel import reduce_rows


@dataclass(frozen=True)
class TowerShape:
    """What every Qwen vision tower's config has: widths, patching and rotary base. Each family's
    config adds its own fields (windows, activation, deepstack), all with defaults."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    def check_heads(self) -> None:
        if self.hidden_size % self.num_heads:
            raise CheckpointError(f"config.json: vision hidden size {self.hidden_size} is not divisible by "
                                  f"num_heads {self.num_heads}")


class VisionSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.tp: Any = None  # a tensor-parallel shard's group (`TPGroup`): proj's product is summed over it

    def forward(self, x: torch.Tensor | Fp8Rows, cos: torch.Tensor, sin: torch.Tensor, seg: Segments,
                attention: VisionAttention) -> torch.Tensor:
        q, k, v = rotary_qk(self.qkv(x), cos, sin, self.num_heads)  # rotated in float32, as the reference
        out = attention.forward(q, k, v, seg)
        return reduce_rows(self.tp, self.proj(rearrange(out, "n heads d -> n (heads d)")))


class VisionRotary(nn.Module):
    """Axial 2-D rotary: a quarter of the head dim for rows, a quarter for columns, doubled."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", on_ambient_device(self._inv_freq()), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        dim = self.head_dim // 2
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))

    def init_buffers(self) -> None:
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, order: torch.Tensor,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] float32 of the patches `order` picks from positions [P, 2]."""
        return rotary_tables(positions, order, self.inv_freq, out)


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))): the vision MLP of Qwen2-VL (QuickGELU) and Qwen3-VL (GELU-tanh). On CUDA
    the tanh GELU runs in fc1's cuBLASLt epilogue (one kernel less per block; the pre-activation
    is not rounded to the model dtype first, a difference within bfloat16's rounding)."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=True)
        self.fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = activation(act)
        self.gelu_tanh = act == "gelu_pytorch_tanh"
        self.tp: Any = None  # a tensor-parallel shard's group (`TPGroup`): fc2's product is summed over it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh and x.is_cuda and x.dim() == 2 and isinstance(self.fc1, nn.Linear):  # not an FP8 fc1
            hidden = torch._addmm_activation(self.fc1.bias, x, self.fc1.weight.t(), use_gelu=True)
        else:
            hidden = self.act(self.fc1(x))
        return reduce_rows(self.tp, self.fc2(hidden))


class LayerNormBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.)), LayerNorms with bias (eps 1e-6). Each residual
    add is fused with the norm after it (`add_layer_norm`), as the RMSNorm blocks do: a block takes
    norm1(x) precomputed and returns its output with the next norm of it."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionSelfAttention(dim, num_heads)
        self.mlp = PlainMLP(dim, mlp_dim, act)

    def forward(self, residual: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seg: Segments, attention: VisionAttention, next_norm: nn.LayerNorm | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n2 = self.norm2
        residual, normed = add_layer_norm(residual, self.attn(normed, cos, sin, seg, attention), n2.weight, n2.bias,
                                          n2.eps)
        out = self.mlp(normed)
        if next_norm is None:  # the last block before a norm that is not per patch row
            return residual + out, None
        return add_layer_norm(residual, out, next_norm.weight, next_norm.bias, next_norm.eps)


def run_blocks(blocks: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments,
               attention: VisionAttention, last_norm: nn.LayerNorm | None,
               taps: dict[int, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """LayerNorm blocks over `hidden`; returns (output, last_norm(output), and `taps[i](output of
    block i)` for the blocks `taps` names, in block order)."""
    first = blocks[0].norm1
    residual, normed = add_layer_norm(hidden, None, first.weight, first.bias, first.eps)
    tapped: list[torch.Tensor] = []
    for index, block in enumerate(blocks):
        following = blocks[index + 1].norm1 if index + 1 < len(blocks) else last_norm
        residual, normed = block(residual, normed, cos, sin, seg, attention, following)
        if taps and index in taps:
            tapped.append(taps[index](residual))
    return residual, normed, tapped


class LayerNormMerger(nn.Module):
    """Each merge block's m*m patch rows become one row of the language model's width:
    LayerNorm, concatenation of the block's rows, fc1, GELU, fc2. `postshuffle`: the norm runs
    on the concatenated row (Qwen3-VL's deepstack mergers) instead of on each patch row."""

    def __init__(self, context_dim: int, out_dim: int, merge_size: int, postshuffle: bool = False) -> None:
        super().__init__()
        self.unit = merge_size * merge_size
        self.hidden = context_dim * self.unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else context_dim, eps=1e-6)
        self.fc1 = nn.Linear(self.hidden, self.hidden)
        self.fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            return self.project(self.norm(self.gather(x)))
        return self.project(self.gather(self.norm(x)))

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """fc1, GELU, fc2 on normalised rows (gathered, unless the norm was applied per patch row:
        then they are gathered here)."""
        if normed.shape[-1] != self.hidden:
            normed = self.gather(normed)
        return self.fc2(F.gelu(self.fc1(normed)))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, d] patch rows in merge-block order -> [N / unit, unit * d], one row per block."""
        return rearrange(x, "(blocks unit) d -> blocks (unit d)", unit=self.unit)


class VisionTower(nn.Module):
    """What every tower does the same way outside its graph region: the Conv3d patch embedding as
    one matmul (with its bias, where the family has one) over the patches in pack order, the
    rotary tables, the out width, and the eager encode. A subclass builds `patch_embed`, `rotary`
    and `cfg`, and supplies `forward_blocks`."""

    cfg: Any
    patch_embed: nn.Linear
    rotary: VisionRotary

    @property
    def out_dim(self) -> int:
        return self.cfg.out_hidden_size

    def embed(self, pixel_values: torch.Tensor, patch_order: torch.Tensor, meta: VisionPackMeta | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Patch embedding of the patches `patch_order` picks: [N, C*T*P*P] -> [N, hidden] (into `out`)."""
        x = pixel_values.index_select(0, patch_order).to(self.patch_embed.weight.dtype)
        weight, bias = self.patch_embed.weight.t(), self.patch_embed.bias
        if bias is None:
            return torch.matmul(x, weight, out=out)
        return torch.addmm(bias, x, weight) if out is None else torch.addmm(bias, x, weight, out=out)

    def rotary_tables(self, positions: torch.Tensor, patch_order: torch.Tensor,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, patch_order, out)

    def forward(self, pixel_values: torch.Tensor, meta: VisionPackMeta) -> torch.Tensor:
        """Encode a pack of images eagerly: [N, patch_dim] -> merged rows (see `forward_blocks`)."""
        return encode_eager(self, pixel_values, meta)


def encode_eager(vit: Any, pixel_values: torch.Tensor, meta: VisionPackMeta) -> torch.Tensor:
    """A pack through a tower without graphs: the same three calls the graph runner makes, on
    tensors of the pack's own size."""
    device = pixel_values.device
    order = to_device(meta.patch_order, device)
    hidden = vit.embed(pixel_values, order, meta)
    cos, sin = vit.rotary_tables(to_device(meta.positions, device), order)
    full = segments_of(meta.full_lengths, device)
    windows = segments_of(meta.window_lengths, device)
    inverse = to_device(meta.merged_inverse, device)
    return vit.forward_blocks(hidden, cos, sin, full, windows, inverse)
