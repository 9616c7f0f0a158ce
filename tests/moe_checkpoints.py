"""Qwen3-VL-MoE checkpoints in the other layouts that exist, written from a tiny one by the tests:
one tensor per expert and projection (the Qwen team's FP8 releases' layout), in the checkpoint's
dtype or as block-scaled FP8 with uneven scales, beside the same weights dequantized by hand."""

from __future__ import annotations

import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from tests.unit.test_fp8_checkpoints import _is_lm_linear, _write, quantize_blocks

FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _experts_apart(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A 3D experts tensor in transformers' layout as one 2D weight per expert and projection."""
    prefix, which = FUSED_EXPERTS.match(name).groups()
    out = []
    for e, weight in enumerate(tensor):
        if which == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", weight))
        else:
            gate, up = weight.chunk(2, dim=0)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
    return out


def per_expert(source: str, target: str) -> str:
    """`source` with its experts stored one tensor per expert and projection, unquantized."""
    shutil.copytree(source, target)
    file = os.path.join(target, "model.safetensors")
    tensors = {}
    for name, tensor in load_file(file).items():
        tensors.update(_experts_apart(name, tensor) if FUSED_EXPERTS.match(name) else {name: tensor})
    save_file({n: t.contiguous() for n, t in tensors.items()}, file, metadata={"format": "pt"})
    return target


def fp8_per_expert(source: str, tmp, block: tuple[int, int] = (128, 128), dense: bool = True) -> tuple[str, str]:
    """(`source` as a block-scaled FP8 checkpoint in the Qwen releases' layout: every expert's
    projections and (with `dense`) the attention and dense MLP projections in FP8 with
    `weight_scale_inv`, the routers and the vision tower as they were; the same weights
    dequantized by hand in float32, experts in transformers' 3D layout)."""
    rows, cols = block
    stored, by_hand = {}, {}
    for k, (name, tensor) in enumerate(sorted(load_file(os.path.join(source, "model.safetensors")).items())):
        if FUSED_EXPERTS.match(name):
            parts, dequantized = _experts_apart(name, tensor.float()), []
            for j, (part_name, weight) in enumerate(parts):
                q, scale = quantize_blocks(weight, rows, cols, seed=1000 * k + j)
                stored[part_name], stored[part_name + "_scale_inv"] = q, scale
                full = scale.repeat_interleave(rows, 0)[:weight.shape[0]].repeat_interleave(cols, 1)[:, :weight.shape[1]]
                dequantized.append(q.float() * full)
            if name.endswith("down_proj"):
                by_hand[name] = torch.stack(dequantized)
            else:
                by_hand[name] = torch.stack([torch.cat(dequantized[i:i + 2]) for i in range(0, len(dequantized), 2)])
        elif dense and _is_lm_linear(name):
            q, scale = quantize_blocks(tensor.float(), rows, cols, seed=k)
            stored[name], stored[name + "_scale_inv"] = q, scale
            full = scale.repeat_interleave(rows, 0)[:tensor.shape[0]].repeat_interleave(cols, 1)[:, :tensor.shape[1]]
            by_hand[name] = q.float() * full
        else:
            stored[name] = by_hand[name] = tensor
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [rows, cols],
              "modules_to_not_convert": ["lm_head", "visual", "mlp.gate"]}
    name = f"moe_{rows}x{cols}" + ("" if dense else "_experts_only")
    return _write(source, str(tmp / f"fp8_{name}"), stored, config), _write(source, str(tmp / f"by_hand_{name}"),
                                                                          by_hand, None)
