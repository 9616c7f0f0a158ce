"""Tensor parallelism for the Qwen vision towers (`EngineConfig.vit_parallel="tensor"`): each block
split the Megatron way over N ranks, every rank running the same pack.

- attention: the fused qkv column-parallel by heads (rank r: heads [r*H/N, (r+1)*H/N) of q, of k
  and of v); proj row-parallel over those heads' columns, then one all-reduce;
- MLP: gate/up (Qwen2.5-VL) or fc1 (Qwen2-VL, Qwen3-VL) column-parallel, down / fc2
  row-parallel, one all-reduce;
- the patch embedding, norms, rotary tables and the mergers (main and deepstack) stay whole on
  every rank: a merger is a few percent of the tower's work, and splitting it would add two
  collectives for little.
A row-parallel layer's bias is added once (rank 0's; the others hold zeros). Every rank ends each
block with the same sums, so the tower's output is replicated, bit for bit across ranks.

The tower is sharded after it is loaded whole (a tower is small next to the language model:
reading its slices alone would save little), before the kernels' width padding
(`prepare_for_kernels`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmpipe.errors import UnsupportedModelError
from mmpipe.layers.mlp import GatedMLP
from mmpipe.layers.parallel import TPGroup, column_parallel, head_rows, row_parallel, shard_gated_mlp


def check_vision_shardable(cfg: Any, size: int) -> None:
    """An `UnsupportedModelError` when `size` ranks cannot split the tower's heads."""
    heads = cfg.num_heads
    if heads % size:
        raise UnsupportedModelError(f"vit_parallel='tensor' with tensor_parallel_size={size}: does not divide the "
                                    f"vision tower's {heads} attention heads (use vit_parallel='data')")


def shard_vision_tower(vit: nn.Module, tp: TPGroup) -> nn.Module:
    """Make a loaded tower rank `tp.rank`'s shard, in place; returns it."""
    check_vision_shardable(vit.cfg, tp.size)
    for block in vit.blocks:
        _shard_attention(block.attn, tp)
        mlp = block.mlp
        try:
            if isinstance(mlp, GatedMLP):
                shard_gated_mlp(mlp, tp)
            else:
                _shard_plain_mlp(mlp, tp)
        except ValueError as exc:
            raise UnsupportedModelError(f"vit_parallel='tensor': {exc} of the vision tower") from None
    vit.tp = tp
    return vit


def _shard_attention(attn: Any, tp: TPGroup) -> None:
    n, r = tp.size, tp.rank
    d, dim = attn.head_dim, attn.qkv.in_features
    heads = attn.num_heads // n
    rows = torch.cat([head_rows(r * heads, heads, d, offset) for offset in (0, dim, 2 * dim)])
    attn.qkv = column_parallel(attn.qkv, rows)
    attn.proj = row_parallel(attn.proj, r * heads * d, (r + 1) * heads * d, tp)
    attn.num_heads, attn.tp = heads, tp


def _shard_plain_mlp(mlp: Any, tp: TPGroup) -> None:
    width, n, r = mlp.fc1.out_features, tp.size, tp.rank
    if width % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the MLP width {width}")
    part = width // n
    mlp.fc1 = column_parallel(mlp.fc1, torch.arange(r * part, (r + 1) * part))
    mlp.fc2 = row_parallel(mlp.fc2, r * part, (r + 1) * part, tp)
    mlp.tp = tp
