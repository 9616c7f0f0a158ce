"""Tensor parallelism for the Qwen2/Qwen3 language model, Megatron style: the sharded forward.

Each of N ranks (one process per GPU, `torch.distributed` over NCCL; gloo on the CPU for tests)
holds 1/N of every large weight and runs the same forward:

- qkv: column-parallel by heads. Rank r computes query heads [r*H/N, (r+1)*H/N). KV heads are
  divided the same way when there are at least N of them (KV % N == 0); with fewer, each is
  replicated: rank r holds KV head r*KV // N, the one its query heads attend with (N % KV == 0).
- o: row-parallel (the rank's query heads' input columns), then one all-reduce.
- gate/up: column-parallel (1/N of the intermediate width each); down: row-parallel, one all-reduce.
  A mixture of experts splits every expert the same way (`shard_experts`: 1/N of each expert's
  width, the router whole on every rank), one all-reduce of the layer's output; or, with
  expert parallelism (`TPGroup.expert_parallel`), splits the experts themselves (`hold_experts`:
  E/N whole experts a rank, each row's experts on other ranks adding nothing there), the same
  all-reduce summing the ranks' parts.
  Both are plain Linear layers (`mmpipe.layers.parallel`): decode steps run them on the few-row
  kernels, whose K-split partial sums are all-reduced as they are; FP8 (`quantization="fp8"`, or
  an FP8 checkpoint's scales, split with their weights) applies to a shard like to any layer.
- embedding: vocabulary-parallel (rank r holds rows [r*P, (r+1)*P), P = ceil(V/N), the last rank's
  padded with zero rows when N does not divide V); ids outside a rank's rows look up zeros, and an
  all-reduce sums the one real row.
- LM head: vocabulary-parallel columns, padded the same way; the logits are gathered and cut back
  to the V real columns.
Norms, rotary tables and everything per token are replicated. The sum in the all-reduce adds the
ranks' partial products in a fixed order, so ranks agree bit for bit with each other, and with the
unsharded model up to that summation order (float32: ~1e-6 relative).

`shard_language_model` turns a model into rank r's shard in place: a loaded one (its slices
copied), or one on the meta device (its structure only), which `shard_slices` then fills by
naming the part of each checkpoint tensor the rank reads (`mmpipe.models.load_model(tp=...)`:
a rank reads only its slices from the files). The collectives go through a `TPGroup`
(`mmpipe.layers.parallel`): the default `torch.distributed` group, or a standalone backend (NCCL on GPUs,
gloo on the CPU) that the Pipeline makes for its own ranks (`mmpipe.engine.tensor_parallel`), so a
process that already belongs to another group (`mmpipe caption --gpus N`, which runs under
accelerate) can hold one. Every collective is launched on the current stream's order, so the
decode and prefill graphs capture them like any other kernel.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmpipe.errors import UnsupportedModelError
from mmpipe.kernels.moe import SCALE_BLOCK
from mmpipe.layers.fp8_experts import Fp8Experts
from mmpipe.layers.parallel import (  # (TPGroup re-exported: the group the shards use)
    NOTHING,
    ExpertSlice,
    Slice,
    TPGroup,
    column_parallel,
    head_rows,
    row_parallel,
    shard_gated_mlp,
)

# An expert's projection stored apart (the Qwen team's FP8 releases): gate and up split by rows, down by columns.
PER_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding table; other ids look up zeros, then the ranks'
    lookups are summed."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of `t`, zero rows past its end (a padded vocabulary shard)."""
    out = t.new_zeros(count, *t.shape[1:])
    real = max(0, min(count, t.shape[0] - start))
    out[:real] = t[start:start + real]
    return out


def check_shardable(cfg: Any, size: int, expert_parallel: bool = False) -> None:
    """An `UnsupportedModelError` naming what does not divide (before anything is sharded)."""
    problems = []
    experts = getattr(cfg, "num_experts", 0)
    if expert_parallel and not experts:
        raise UnsupportedModelError("expert_parallel: the model has no mixture-of-experts layers")
    if expert_parallel and experts % size:
        problems.append(f"its {experts} experts (expert parallelism splits whole experts)")
    elif experts and not expert_parallel and cfg.moe_intermediate_size % size:
        problems.append(f"the experts' width {cfg.moe_intermediate_size}")
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither a multiple nor a divisor of it)")
    if problems:
        raise UnsupportedModelError(f"tensor_parallel_size={size} does not divide {', '.join(problems)}")


class HeadShard(nn.Module):
    """An untied LM head's vocabulary rows on this rank (`lm_head.weight` when loading)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


def _layout(cfg: Any, tp: TPGroup) -> tuple[int, int, int, int]:
    """(query heads, KV heads, first KV head, vocabulary rows) of rank `tp.rank`."""
    n, r = tp.size, tp.rank
    heads = cfg.num_heads // n
    kv_heads = cfg.num_kv_heads // n if cfg.num_kv_heads % n == 0 else 1
    kv_first = r * kv_heads if cfg.num_kv_heads % n == 0 else r * cfg.num_kv_heads // n
    return heads, kv_heads, kv_first, -(-cfg.vocab_size // n)


def shard_slices(cfg: Any, tp: TPGroup) -> Any:
    """For loading only a rank's part of each checkpoint tensor: a function from a language-model
    tensor's name (inside the language model, as the checkpoint names it) to the `Slice` this
    rank holds, or None for a tensor every rank holds whole. The same split as
    `shard_language_model`, on the checkpoint's unfused q/k/v and gate/up tensors."""
    check_shardable(cfg, tp.size, tp.expert_parallel)
    if cfg.intermediate_size % tp.size:
        raise UnsupportedModelError(f"tensor_parallel_size={tp.size} does not divide the MLP width "
                                    f"{cfg.intermediate_size}")
    r, d = tp.rank, cfg.head_dim
    heads, kv_heads, kv_first, vocab = _layout(cfg, tp)
    q = (r * heads * d, (r + 1) * heads * d)
    kv = (kv_first * d, (kv_first + kv_heads) * d)
    part = cfg.intermediate_size // tp.size
    mlp = (r * part, (r + 1) * part)
    experts = cfg.moe_intermediate_size // tp.size
    expert_parts: dict[str, Slice | ExpertSlice] = {
        ".mlp.experts.gate_up_proj": ExpertSlice(cfg.moe_intermediate_size, 2, r * experts, (r + 1) * experts),
        ".mlp.experts.down_proj": ExpertSlice(cfg.moe_intermediate_size, 1, r * experts, (r + 1) * experts)}
    expert = (r * experts, (r + 1) * experts)
    held = _held_experts(cfg, tp) if tp.expert_parallel else None
    if held is not None:  # whole experts: the first dimension of the 3D tensors in either layout
        expert_parts = dict.fromkeys(expert_parts, Slice(0, held[0], held[1], held[1] - held[0]))
    rows = {".self_attn.q_proj.": q, ".self_attn.k_proj.": kv, ".self_attn.v_proj.": kv,
            ".mlp.gate_proj.": mlp, ".mlp.up_proj.": mlp}
    columns = {".self_attn.o_proj.": q, ".mlp.down_proj.": mlp}

    def select(name: str) -> Slice | ExpertSlice | None:
        for part_name, part in expert_parts.items():
            if name.endswith(part_name):
                return part
        one_expert = PER_EXPERT_WEIGHT.search(name)  # an expert's projection stored apart
        if one_expert is not None and held is not None:
            return None if held[0] <= int(one_expert.group(1)) < held[1] else NOTHING
        if one_expert is not None:
            lo, hi = expert
            return Slice(1 if one_expert.group(2) == "down" else 0, lo, hi, hi - lo)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return Slice(0, r * vocab, min((r + 1) * vocab, cfg.vocab_size), vocab)
        for part_name, (lo, hi) in rows.items():
            if part_name in name:
                return Slice(0, lo, hi, hi - lo)
        for part_name, (lo, hi) in columns.items():
            if part_name in name and name.endswith(".weight"):
                return Slice(1, lo, hi, hi - lo)
        return None

    return select


def shard_language_model(lm: nn.Module, tp: TPGroup) -> nn.Module:
    """Make `lm` (a loaded `Qwen2LanguageModel`, every rank holding the same weights) rank
    `tp.rank`'s shard, in place; returns it. Its `cfg` then holds the rank's head counts and
    intermediate width (the vocabulary stays whole: logits are gathered)."""
    if getattr(lm, "tp", None) is not None:
        raise ValueError("shard_language_model: this language model is a shard already")
    cfg, n, r = lm.cfg, tp.size, tp.rank
    check_shardable(cfg, n, tp.expert_parallel)
    d = cfg.head_dim
    heads, kv_heads, kv_first, vocab = _layout(cfg, tp)
    q_total, kv_total = cfg.num_heads * d, cfg.num_kv_heads * d
    for layer in lm.layers:
        attn = layer.self_attn
        row_parallel_layers = (attn.o_proj, getattr(layer.mlp, "down_proj", attn.o_proj))  # (experts: no bias)
        if any(m.bias is not None and m.weight.device.type == "meta" for m in row_parallel_layers):
            # A shard read from the checkpoint would hold the whole bias on every rank and add it
            # N times (`shard_slices` cuts weights only); no supported family has one.
            raise UnsupportedModelError("tensor parallelism: row-parallel o_proj/down_proj with a bias is not supported")
        rows = torch.cat([head_rows(r * heads, heads, d), head_rows(kv_first, kv_heads, d, q_total),
                          head_rows(kv_first, kv_heads, d, q_total + kv_total)])
        attn.qkv_proj = column_parallel(attn.qkv_proj, rows)
        attn.o_proj = row_parallel(attn.o_proj, r * heads * d, (r + 1) * heads * d, tp)
        attn.num_heads, attn.num_kv_heads, attn.tp = heads, kv_heads, tp
        attn.q_size, attn.kv_size = heads * d, kv_heads * d
        if hasattr(layer.mlp, "experts"):
            (hold_experts if tp.expert_parallel else shard_experts)(layer.mlp, tp)
            continue
        try:
            shard_gated_mlp(layer.mlp, tp)  # its width after any padding
        except ValueError as exc:
            raise UnsupportedModelError(str(exc)) from None
    # `vocab` rows per rank, the last rank's padded with zeros. Tied: the head is the embedding's rows.
    table = lm.embed_tokens.weight
    if lm.lm_head is not None:
        lm.lm_head = HeadShard(_rows(lm.lm_head.weight, r * vocab, vocab))
    lm.embed_tokens = VocabParallelEmbedding(_rows(table, r * vocab, vocab), r * vocab, tp)
    lm.tp = tp
    # The unsharded model's lookups read the whole table; a shard's go through its collectives.
    lm.embed = lambda ids, out=None: lm.embed_tokens(ids) if out is None else out.copy_(lm.embed_tokens(ids))
    lm.compute_logits = lambda hidden: sharded_logits(lm, hidden)
    width = cfg.moe_intermediate_size if tp.expert_parallel else cfg.moe_intermediate_size // n
    lm.cfg = replace(cfg, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=cfg.intermediate_size // n,
                     moe_intermediate_size=width)
    return lm


def shard_experts(moe: nn.Module, tp: TPGroup) -> None:
    """A `SparseMoE` made rank `tp.rank`'s shard in place: every expert's gate and up rows and
    down columns [r * W/N, (r + 1) * W/N) of its width W (the router stays whole, so every rank
    routes alike), FP8 experts' tile scales with them (W/N a multiple of their 128-wide tiles);
    its output then sums over the ranks (`moe.tp`)."""
    experts, n, r = moe.experts, tp.size, tp.rank
    width = experts.down_proj.shape[2]
    part = width // n
    tensors = [("gate_up_proj", 2, 1), ("down_proj", 1, 1)]
    if isinstance(experts, Fp8Experts):
        if part % SCALE_BLOCK:
            raise UnsupportedModelError(f"tensor_parallel_size={n}: FP8 experts of width {width} split into parts of "
                                        f"{part}, not whole {SCALE_BLOCK}-wide blocks of scales")
        tensors += [("gate_up_scale", 2, SCALE_BLOCK), ("down_scale", 1, SCALE_BLOCK)]
    for name, blocks, unit in tensors:
        whole = getattr(experts, name)
        cut = ExpertSlice(width // unit, blocks, r * part // unit, (r + 1) * part // unit)
        if whole.device.type == "meta":
            shape = list(whole.shape)
            shape[cut.held_dim] = blocks * part // unit
            value = torch.empty(shape, dtype=whole.dtype, device="meta")
        else:
            value = cut.of(whole).contiguous()
        if isinstance(whole, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        setattr(experts, name, value)
    moe.tp = tp


def sharded_logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits over the whole vocabulary from a shard: each rank's columns, gathered (the
    padding columns of an uneven split cut off)."""
    head = lm.embed_tokens.weight if lm.lm_head is None else lm.lm_head.weight
    local = F.linear(hidden, head).float()  # rounded to the model dtype first, as unsharded
    return lm.tp.all_gather_last(local)[..., :lm.cfg.vocab_size]


def _held_experts(cfg: Any, tp: TPGroup) -> tuple[int, int]:
    """Expert parallelism: the experts [first, last) that rank `tp.rank` holds whole."""
    count = cfg.num_experts // tp.size
    return tp.rank * count, (tp.rank + 1) * count


def hold_experts(moe: nn.Module, tp: TPGroup) -> None:
    """A `SparseMoE` made rank `tp.rank`'s part under expert parallelism, in place: experts
    [r * E/N, (r + 1) * E/N) whole (FP8 experts with their scales), the router whole; rows that
    chose other ranks' experts get nothing from this rank (`moe.expert_offset`), and the output
    sums over the ranks (`moe.tp`)."""
    experts = moe.experts
    count = experts.down_proj.shape[0] // tp.size
    first = tp.rank * count
    for name, whole in list(experts.named_parameters(recurse=False)) + list(experts.named_buffers(recurse=False)):
        if whole.device.type == "meta":
            value = torch.empty((count, *whole.shape[1:]), dtype=whole.dtype, device="meta")
        else:
            value = whole[first:first + count].contiguous()
        setattr(experts, name, nn.Parameter(value, requires_grad=False) if isinstance(whole, nn.Parameter) else value)
    moe.expert_offset = first
    moe.tp = tp
