"""Qwen2.5-VL vision transformer: patch embedding, 2-D rotary, window/full attention blocks, merger.

Split for graph capture: `embed` (patch embedding, outside the graph), `rotary` (cos/sin
tables, outside), and `forward_blocks` (all blocks + merger + un-permutation: the graph region).
Inside `forward_blocks` nothing depends on host values: segment boundaries and permutations
arrive as tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from mmpipe.vision.attention import TorchVisionAttention, VisionAttention
from mmpipe.vision.layers import TowerShape, VisionRotary, VisionSelfAttention, VisionTower
from mmpipe.vision.metadata import Segments
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.kernels.fused import add_rms_norm
from mmpipe.layers.fp8 import Fp8Rows, fp8_input
from mmpipe.layers.mlp import GatedMLP
from mmpipe.layers.norm import RMSNorm
from mmpipe.layers.weight_map import WeightMap


@dataclass(frozen=True)
class VisionConfig(TowerShape):
    """Qwen2.5-VL's tower: windowed blocks except the full-attention ones, gated SiLU MLPs."""

    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "VisionConfig":
        vc = cfg.get("vision_config") or {}
        rope = vc.get("rope_parameters") or {}
        try:
            out = cls(
                depth=int(vc["depth"]),
                hidden_size=int(vc["hidden_size"]),
                intermediate_size=int(vc["intermediate_size"]),
                num_heads=int(vc["num_heads"]),
                out_hidden_size=int(vc["out_hidden_size"]),
                in_channels=int(vc.get("in_channels", vc.get("in_chans", 3))),
                patch_size=int(vc.get("patch_size", 14)),
                temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
                spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
                window_size=int(vc.get("window_size", 112)),
                fullatt_block_indexes=tuple(int(i) for i in vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
                hidden_act=str(vc.get("hidden_act", "silu")),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json: vision_config lacks {exc.args[0]!r}") from None
        out.check_heads()
        return out


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = VisionSelfAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=True)

    def forward(self, residual: torch.Tensor, normed: torch.Tensor | Fp8Rows, cos: torch.Tensor, sin: torch.Tensor,
                seg: Segments, attention: VisionAttention, next_norm: RMSNorm, next_proj: nn.Module | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """x + attn(norm1(x)), then + mlp(norm2(.)); takes norm1(x) precomputed and returns the
        new residual with `next_norm` of it, so every residual add fuses with the next norm. A norm
        whose reader quantizes its input (`fp8-all`, `fp8_input`; `next_proj` reads `next_norm`'s)
        comes quantized that way (`Fp8Rows`)."""
        residual, normed = add_rms_norm(residual, self.attn(normed, cos, sin, seg, attention), self.norm2.weight,
                                        self.norm2.eps, fp8_input(self.mlp.gate_up_proj, residual))
        fp8 = fp8_input(next_proj, residual)  # (None: no reader of the norm to quantize for)
        return add_rms_norm(residual, self.mlp(normed), next_norm.weight, next_norm.eps, fp8)


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, context_dim: int, merge_size: int) -> None:
        super().__init__()
        self.unit = merge_size * merge_size
        self.hidden = context_dim * self.unit
        self.ln_q = RMSNorm(context_dim)
        self.fc1 = nn.Linear(self.hidden, self.hidden)
        self.fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.ln_q(x))

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """The MLP on rows already normalised by ln_q, merge_size^2 rows at a time."""
        return self.fc2(F.gelu(self.fc1(rearrange(normed, "(blocks unit) d -> blocks (unit d)", unit=self.unit))))


class Qwen25VisionTransformer(VisionTower):
    def __init__(self, cfg: VisionConfig, attention: VisionAttention | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.patch_embed = nn.Linear(self.patch_dim, cfg.hidden_size, bias=False)
        self.rotary = VisionRotary(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.hidden_size, cfg.spatial_merge_size)
        self.full_blocks = frozenset(cfg.fullatt_block_indexes)
        self.attention: VisionAttention = attention if attention is not None else TorchVisionAttention()

    # ---- the graph region

    def forward_blocks(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full: Segments,
                       windows: Segments, merged_inverse: torch.Tensor) -> torch.Tensor:
        """Blocks + merger on window-ordered patches; returns merged rows in image order."""
        first = self.blocks[0].norm1
        residual, normed = add_rms_norm(hidden, None, first.weight, first.eps,
                                        fp8_input(self.blocks[0].attn.qkv, hidden))
        for index, block in enumerate(self.blocks):
            seg = full if index in self.full_blocks else windows
            last = index + 1 == len(self.blocks)
            following = self.merger.ln_q if last else self.blocks[index + 1].norm1
            # (the merger's norm stays in the model's dtype: its rows are regrouped before fc1)
            residual, normed = block(residual, normed, cos, sin, seg, self.attention, following,
                                     None if last else self.blocks[index + 1].attn.qkv)
        return self.merger.project(normed).index_select(0, merged_inverse)

    # ---- weights

    def weight_map(self) -> WeightMap:
        """Checkpoint names (relative to the vision tower) -> parameters."""
        inter = self.cfg.intermediate_size
        return WeightMap(
            self,
            renames={"patch_embed.proj.": "patch_embed.", "merger.mlp.0.": "merger.fc1.",
                     "merger.mlp.2.": "merger.fc2."},
            fused={".mlp.gate_proj.": (".mlp.gate_up_proj.", 0), ".mlp.up_proj.": (".mlp.gate_up_proj.", 1)},
            blocks={".mlp.gate_up_proj.": [inter, inter]},
        )
