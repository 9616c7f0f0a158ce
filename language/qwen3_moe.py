"""The Qwen3 mixture-of-experts decoder of Qwen3-VL-MoE (30B-A3B, 235B-A22B): the dense Qwen3
decoder of `language/qwen3.py` whose MLP, in the sparse layers, is a router and a set of experts.

The router scores every expert (a linear layer without bias), takes the softmax in float32, keeps
the `experts_per_token` best and renormalises their weights to sum to one; each token's output is
the weighted sum of its chosen experts' gated MLPs (SiLU(gate) * up, then down). Layers in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep the dense MLP.

Routing and experts run in `mmpipe.kernels.moe`: fused kernels on CUDA that read only the chosen
experts' weights and never wait for the host (so the decode graphs and the prefill pieces hold
them), and elsewhere a reference that runs every expert over every row, as exact as transformers'
loop in float32.

Expert weights are two 3D tensors per layer, `experts.gate_up_proj` [experts, 2 * width, hidden]
and `experts.down_proj` [experts, hidden, width] (transformers' layout in memory, and what it
writes). Checkpoints store them in one of three ways, all read by `ExpertWeightMap`: that layout;
the published bfloat16 files' (each tensor's last two dimensions swapped); or one tensor per
expert and projection (`experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`), as the Qwen team's
block-scaled FP8 releases do, each with its `weight_scale_inv`. FP8 experts stay in FP8 on GPUs
with FP8 tensor cores (`Fp8Experts`, placed by `mmpipe.weights.place_fp8_experts`), and are
dequantized at load elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from mmpipe.language.qwen2 import TextConfig, text_fields
from mmpipe.language.qwen3 import Qwen3LanguageModel, qwen3_text_config
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.kernels import moe
from mmpipe.kernels.partial_sums import PartialSums
from mmpipe.layers.fp8_experts import Fp8Experts
from mmpipe.layers.parallel import reduce_rows
from mmpipe.layers.weight_map import WeightMap, copy_into

EXPERT_TENSORS = (".experts.gate_up_proj", ".experts.down_proj")
# One expert's projection as a checkpoint stores it apart: (experts module, expert, projection, kind).
PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
MOE_KEYS = ("num_experts", "num_local_experts", "moe_intermediate_size")  # what the dense config refuses


def qwen3_moe_text_config(cfg: dict[str, Any]) -> TextConfig:
    """Qwen3's config plus the experts: how many, how many per token, their width, and which
    layers have them (every `decoder_sparse_step`-th, except `mlp_only_layers`)."""
    tc = text_fields(cfg)
    try:
        experts = int(tc.get("num_experts") or tc["num_local_experts"])
        per_token, width = int(tc["num_experts_per_tok"]), int(tc["moe_intermediate_size"])
    except KeyError as exc:
        raise CheckpointError(f"config.json: the mixture-of-experts config lacks {exc.args[0]!r}") from None
    layers, step = int(tc["num_hidden_layers"]), int(tc.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in tc.get("mlp_only_layers") or ()}
    if not 0 < per_token <= experts:
        raise CheckpointError(f"config.json: num_experts_per_tok={per_token} with {experts} experts")
    if tc.get("hidden_act", "silu") not in ("silu", "swish"):
        raise CheckpointError(f"config.json: experts with hidden_act={tc['hidden_act']!r} (the expert kernels take silu)")
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    dense_cfg = {k: v for k, v in cfg.items() if k not in MOE_KEYS}
    dense_cfg["text_config"] = {k: v for k, v in tc.items() if k not in MOE_KEYS}
    return replace(qwen3_text_config(dense_cfg), num_experts=experts, experts_per_token=per_token,
                   moe_intermediate_size=width, moe_layers=sparse)


class Experts(nn.Module):
    """The experts' weights as two 3D tensors (see the module docstring for the layout)."""

    def __init__(self, experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))


class SparseMoE(nn.Module):
    """Router (`gate`) and experts of one layer; `forward(x [T, hidden]) -> [T, hidden]`."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.tp: Any = None  # a tensor-parallel shard's group: the output is summed over it
        self.expert_offset: int | None = None  # expert parallelism: the global id of this rank's first expert

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts, best first: (renormalised weights float32, ids int32), [T, top_k]."""
        return moe.route(F.linear(x, self.gate.weight), self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor | PartialSums:
        """On CUDA, `PartialSums` (one slice per chosen expert) for the residual add to sum."""
        weights, ids = self.route(x)
        held = self.experts
        if self.expert_offset is not None:
            ids = moe.local_ids(ids, self.expert_offset, held.down_proj.shape[0])
        scales = held.scales() if isinstance(held, Fp8Experts) else None
        return reduce_rows(self.tp, moe.experts(x, held.gate_up_proj, held.down_proj, weights, ids, scales=scales))


class Qwen3MoeLanguageModel(Qwen3LanguageModel):
    """Qwen3 decoder layers whose MLP is a `SparseMoE` in `cfg.moe_layers`."""

    def __init__(self, cfg: TextConfig, attention: Any = None) -> None:
        super().__init__(cfg, attention)
        for index in cfg.moe_layers:
            self.layers[index].mlp = SparseMoE(cfg)

    def weight_map(self) -> WeightMap:
        base = super().weight_map()
        return ExpertWeightMap(self, fused=base.fused, blocks=base.blocks)


class ExpertWeightMap(WeightMap):
    """`WeightMap` that also takes expert tensors stored transposed (the published layout), and
    one tensor per expert and projection (with its FP8 scale where the experts are `Fp8Experts`);
    a layer's experts count as loaded once every expert's part has come. A shape that fits both
    3D layouts (hidden equal to the experts' width, or to twice it: no published model) is read
    in transformers' layout."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._offsets: dict[str, int] = {}  # experts module -> global id of its first expert (expert parallelism)
        for path, sub in module.named_modules():
            if isinstance(sub, Fp8Experts):
                self.params.update({f"{path}.{name}": buffer for name, buffer in sub.named_buffers()})
            if isinstance(sub, SparseMoE) and sub.expert_offset is not None:
                self._offsets[f"{path}.experts"] = sub.expert_offset
        self._parts: dict[str, set[tuple[int, str]]] = {}  # per-expert parts loaded, by model tensor

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        loaded: set[str] = set()
        unexpected: list[str] = []
        whole = []
        for name, tensor in weights:
            match = PER_EXPERT.match(name)
            target = None if match is None else self._load_part(name, tensor, *match.groups())
            if match is None:
                whole.append((name, self._as_held(name, tensor)))
            elif target is None:
                unexpected.append(name)
            elif self._complete(target):
                loaded.add(target)
        got, extra = super().load(whole)
        return loaded | got, unexpected + extra

    def _load_part(self, name: str, tensor: torch.Tensor, experts: str, index: str, projection: str,
                   kind: str) -> str | None:
        """Copy one expert's projection (or its tile scales) into its rows of the 3D tensor; that
        tensor's name, or None when the model has no such expert."""
        stem = "down" if projection == "down_proj" else "gate_up"
        target = f"{experts}.{stem}_{'proj' if kind == 'weight' else 'scale'}"
        param, e = self.params.get(target), int(index) - self._offsets.get(experts, 0)
        if param is None or not 0 <= e < param.shape[0]:
            return None
        block = param[e]
        if stem == "gate_up":
            half = block.shape[0] // 2
            block = block[:half] if projection == "gate_proj" else block[half:]
        if kind == "weight_scale":
            tensor = tensor[:, :block.shape[1]]  # (kept FP8 scales come with columns padded for cuBLASLt)
        copy_into(block, tensor, name)
        self._parts.setdefault(target, set()).add((e, projection))
        return target

    def _complete(self, target: str) -> bool:
        return len(self._parts[target]) == self.params[target].shape[0] * (2 if ".gate_up_" in target else 1)

    def _as_held(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        param = self.params.get(name)
        if param is None or not name.endswith(EXPERT_TENSORS) or tensor.shape == param.shape:
            return tensor
        if tensor.dim() == 3 and tensor.shape == (param.shape[0], param.shape[2], param.shape[1]):
            return tensor.transpose(1, 2)
        raise CheckpointError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)} or its "
                              "last two dimensions swapped")
