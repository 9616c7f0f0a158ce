"""Qwen2-VL vision transformer: patch embedding, 2-D rotary, full attention within each image,
LayerNorm blocks with a QuickGELU MLP, LayerNorm patch merger.

Split for graph capture as every tower (`vision/layers.py`): `embed` and `rotary_tables` outside
the graph, `forward_blocks` (blocks + merger) inside. No windows: patches keep their order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from mmpipe.vision.attention import TorchVisionAttention, VisionAttention
from mmpipe.vision.layers import (
    LayerNormBlock,
    LayerNormMerger,
    TowerShape,
    VisionRotary,
    VisionTower,
    run_blocks,
)
from mmpipe.vision.metadata import Segments
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.layers.weight_map import WeightMap


@dataclass(frozen=True)
class FullAttentionVisionConfig(TowerShape):
    """The shape of a tower whose blocks all attend over whole images (Qwen2-VL, Qwen3-VL)."""

    hidden_act: str = "quick_gelu"
    num_position_embeddings: int = 0  # Qwen3-VL: the learned table's size (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose output feeds a deepstack merger
    window_size: None = None  # no windowed blocks

    def check(self) -> "FullAttentionVisionConfig":
        self.check_heads()
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise CheckpointError(f"config.json: deepstack_visual_indexes {list(self.deepstack_visual_indexes)} "
                                  f"name blocks outside 0..{self.depth - 1}")
        return self

    @classmethod
    def qwen2_vl(cls, cfg: dict[str, Any]) -> "FullAttentionVisionConfig":
        """Qwen2-VL names the tower's width `embed_dim`; its `hidden_size` is the merger's output."""
        vc = cfg.get("vision_config") or {}
        try:
            width = int(vc["embed_dim"])
            return cls(
                depth=int(vc["depth"]), hidden_size=width, intermediate_size=int(width * float(vc.get("mlp_ratio", 4))),
                num_heads=int(vc["num_heads"]), out_hidden_size=int(vc["hidden_size"]),
                in_channels=int(vc.get("in_channels", vc.get("in_chans", 3))), patch_size=int(vc.get("patch_size", 14)),
                temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
                spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
                hidden_act=str(vc.get("hidden_act", "quick_gelu")),
            ).check()
        except KeyError as exc:
            raise CheckpointError(f"config.json: vision_config lacks {exc.args[0]!r}") from None


class Qwen2VisionTransformer(VisionTower):
    def __init__(self, cfg: FullAttentionVisionConfig, attention: VisionAttention | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.patch_embed = nn.Linear(self.patch_dim, cfg.hidden_size, bias=self.patch_bias)
        self.rotary = VisionRotary(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList(LayerNormBlock(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size,
                                                   cfg.hidden_act) for _ in range(cfg.depth))
        self.merger = LayerNormMerger(cfg.hidden_size, cfg.out_hidden_size, cfg.spatial_merge_size)
        self.attention: VisionAttention = attention if attention is not None else TorchVisionAttention()

    patch_bias = False  # Qwen2-VL's Conv3d patch embedding has no bias

    # ---- the graph region

    def forward_blocks(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full: Segments,
                       windows: Segments | None = None, merged_inverse: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks + merger over whole images (no windows, rows in image order): [N / unit, out_dim].
        The last block's residual add is fused with the merger's per-patch norm."""
        _, normed, _ = run_blocks(self.blocks, hidden, cos, sin, full, self.attention, self.merger.norm)
        return self.merger.project(normed)

    # ---- weights

    def weight_map(self) -> WeightMap:
        """Checkpoint names (relative to the vision tower) -> parameters."""
        return WeightMap(self, renames={"patch_embed.proj.": "patch_embed.", "merger.ln_q.": "merger.norm.",
                                        "merger.mlp.0.": "merger.fc1.", "merger.mlp.2.": "merger.fc2."})
