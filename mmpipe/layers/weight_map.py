"""Copying checkpoint tensors into model parameters, including row blocks of fused parameters.

A model describes how checkpoint names map to its parameters with a `WeightMap`; the generic
loader (`mmpipe.weights`) reads the files and reports what is missing or unexpected.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.layers.fp8 import BLOCK, Fp8Linear


class WeightMap:
    """Checkpoint name -> model parameter, whole or as one row block of a fused parameter.

    `renames`: checkpoint substring -> model substring (first match wins).
    `fused`: checkpoint substring -> (model substring, block index); `blocks` gives, for each
    fused model substring, the row count of each block (q/k/v blocks differ under GQA).
    An FP8 layer's `weight` and `weight_scale` load like parameters; a block-scaled layer's scale
    rows are per 128 weight rows, so a fused part's scale lands at its rows / 128.
    """

    def __init__(self, module: nn.Module, renames: dict[str, str] | None = None,
                 fused: dict[str, tuple[str, int]] | None = None,
                 blocks: dict[str, list[int]] | None = None) -> None:
        self.params = dict(module.named_parameters())
        self.row_units: dict[str, int] = {}  # parameter -> weight rows per row (block scales)
        for path, sub in module.named_modules():
            if isinstance(sub, Fp8Linear):
                prefix = f"{path}." if path else ""
                self.params[prefix + "weight"] = sub.weight
                self.params[prefix + "weight_scale"] = sub.weight_scale
                if sub.bias is not None:
                    self.params[prefix + "bias"] = sub.bias
                if sub.block:
                    self.row_units[prefix + "weight_scale"] = BLOCK
        self.renames = renames or {}
        self.fused = fused or {}
        self.blocks = blocks or {}

    def expected_names(self) -> set[str]:
        """The checkpoint names a complete checkpoint holds for this module."""
        names: set[str] = set()
        for name in self.params:
            parts = [ckpt for ckpt, (model, _) in self.fused.items() if model in name]
            if parts:
                names.update(name.replace(self.fused[p][0], p) for p in parts)
                continue
            for ckpt_sub, model_sub in self.renames.items():
                if model_sub in name:
                    name = name.replace(model_sub, ckpt_sub)
                    break
            names.add(name)
        return names

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        """Copy every tensor; returns (loaded names, unexpected names)."""
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            target, rows = self._target(name)
            param = self.params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            unit = self.row_units.get(target, 1)
            if rows is not None and unit > 1:
                rows = (rows[0] // unit, -(-rows[1] // unit))
            copy_into(param, tensor, name, rows)
            loaded.add(name)
        return loaded, unexpected

    def sources(self, param: str) -> list[tuple[str, int]]:
        """The checkpoint names that fill `param`, with the rows each fills, in row order."""
        for model_sub, sizes in self.blocks.items():
            if model_sub in param:
                parts = sorted((index, ckpt) for ckpt, (model, index) in self.fused.items() if model == model_sub)
                return [(param.replace(model_sub, ckpt), sizes[index]) for index, ckpt in parts]
        name = param
        for ckpt_sub, model_sub in self.renames.items():
            if model_sub in name:
                name = name.replace(model_sub, ckpt_sub)
                break
        return [(name, self.params[param].shape[0])]

    def _target(self, name: str) -> tuple[str, tuple[int, int] | None]:
        for ckpt_sub, (model_sub, index) in self.fused.items():
            if ckpt_sub in name:
                sizes = self.blocks[model_sub]
                return name.replace(ckpt_sub, model_sub), (sum(sizes[:index]), sizes[index])
        for ckpt_sub, model_sub in self.renames.items():
            if ckpt_sub in name:
                return name.replace(ckpt_sub, model_sub), None
        return name, None


def copy_into(param: torch.Tensor, tensor: torch.Tensor, source: str,
              rows: tuple[int, int] | None = None) -> None:
    """Copy `tensor` into `param` (or its rows [offset, offset+count)), checking the shape."""
    target = param if rows is None else param[rows[0]:rows[0] + rows[1]]
    if (tensor.dim() > target.dim() == 2 and tensor.shape[0] == target.shape[0]
            and tensor[0].numel() == target.shape[1]):
        tensor = tensor.reshape(target.shape)  # a Conv patch embedding stored for a Linear
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(f"weight {source!r}: shape {tuple(tensor.shape)} does not match the model's "
                              f"{tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)
