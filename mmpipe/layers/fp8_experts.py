"""FP8 (E4M3) experts of a mixture-of-experts layer: the weights of every expert as two 3D FP8
tensors with one float32 scale per 128 x 128 tile, the format of the Qwen team's block-scaled FP8
releases (which store each expert's gate, up and down projections apart, with their
`weight_scale_inv`), or quantized so at load (`quantization="fp8"`, `quantize_experts`).

Layout, as the plain experts' (`gate_up_proj` [experts, 2 * width, hidden], gate rows then up
rows; `down_proj` [experts, hidden, width]) with the scales beside them: `gate_up_scale`
[experts, 2 * width / 128, hidden / 128] and `down_scale` [experts, hidden / 128, width / 128].
Both the width and the hidden size must be multiples of 128 (`fits`), so no tile straddles the
gate and up blocks; every published Qwen3 MoE shape is. The expert kernels (`mmpipe.kernels.moe`)
read the FP8 weights and apply each tile's scale; activations stay in the run's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from mmpipe.kernels.fp8_quant import FP8, FP8_MAX, TINY
from mmpipe.kernels.moe import SCALE_BLOCK, Scales, dequantize_experts

__all__ = ["Fp8Experts", "fits", "quantize_blocks", "quantize_experts"]


def fits(hidden: int, width: int) -> bool:
    """Whether experts of this hidden size and width take 128 x 128 tiles whole."""
    return hidden % SCALE_BLOCK == 0 and width % SCALE_BLOCK == 0


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, float32 scales [experts, rows / 128, columns / 128]) of a 3D weight whose last
    two dimensions are multiples of 128: each tile's largest magnitude maps to the FP8 maximum."""
    e, rows, cols = weight.shape
    tiles = weight.float().reshape(e, rows // SCALE_BLOCK, SCALE_BLOCK, cols // SCALE_BLOCK, SCALE_BLOCK)
    scale = tiles.abs().amax(dim=(2, 4)).clamp(min=TINY) / FP8_MAX
    values = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.reshape(e, rows, cols), scale


class Fp8Experts(nn.Module):
    """The experts' FP8 weights and tile scales (see the module docstring), as buffers."""

    def __init__(self, experts: int, hidden: int, width: int, device: torch.device | str = "meta") -> None:
        super().__init__()
        if not fits(hidden, width):
            raise ValueError(f"Fp8Experts: hidden {hidden} and width {width} must be multiples of {SCALE_BLOCK}")
        b = SCALE_BLOCK
        self.register_buffer("gate_up_proj", torch.empty(experts, 2 * width, hidden, dtype=FP8, device=device))
        self.register_buffer("gate_up_scale", torch.ones(experts, 2 * width // b, hidden // b, device=device))
        self.register_buffer("down_proj", torch.empty(experts, hidden, width, dtype=FP8, device=device))
        self.register_buffer("down_scale", torch.ones(experts, hidden // b, width // b, device=device))

    @classmethod
    def from_weights(cls, gate_up: torch.Tensor, down: torch.Tensor) -> Fp8Experts:
        """Plain experts' weights quantized into 128 x 128 tiles, one expert at a time (the
        float32 copy of one expert is the most this adds)."""
        experts, hidden, width = down.shape
        out = cls(experts, hidden, width, device=down.device)
        for e in range(experts):
            out.gate_up_proj[e], out.gate_up_scale[e] = (t[0] for t in quantize_blocks(gate_up[e:e + 1]))
            out.down_proj[e], out.down_scale[e] = (t[0] for t in quantize_blocks(down[e:e + 1]))
        return out

    def scales(self) -> Scales:
        return self.gate_up_scale, self.down_scale

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as plain experts' weights in `dtype`."""
        return (dequantize_experts(self.gate_up_proj, self.gate_up_scale, dtype),
                dequantize_experts(self.down_proj, self.down_scale, dtype))

    def extra_repr(self) -> str:
        experts, hidden, width = self.down_proj.shape
        return f"experts={experts}, hidden={hidden}, width={width}, fp8 e4m3, 128x128 block scales"


def quantize_experts(module: nn.Module) -> tuple[int, int]:
    """Replace every plain experts module (a child named `experts` holding 3D `gate_up_proj` and
    `down_proj` parameters) of `module` by its `Fp8Experts`, one layer at a time; returns (layers
    replaced, layers left unquantized because their shape is not made of whole tiles). Only the
    parents' names are held while it runs, so each layer's unquantized experts are freed before
    the next layer is quantized: the peak is the unquantized model plus one layer's FP8 experts."""
    replaced = left = 0
    for path in [path for path, _ in module.named_modules()]:
        parent = module.get_submodule(path)
        child = getattr(parent, "experts", None)
        if not isinstance(child, nn.Module) or isinstance(child, Fp8Experts):
            continue
        gate_up, down = getattr(child, "gate_up_proj", None), getattr(child, "down_proj", None)
        if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and down.dim() == 3):
            continue
        if not fits(down.shape[1], down.shape[2]):
            left += 1
            continue
        parent.experts = Fp8Experts.from_weights(gate_up.detach(), down.detach())
        del child, gate_up, down  # the last references to this layer's unquantized experts
        replaced += 1
    return replaced, left
