"""FP8 checkpoints as published, read from config.json's `quantization_config`.

Two formats of FP8 (E4M3) weights:

- compressed-tensors "float-quantized" (llm-compressor's FP8 and FP8-Dynamic): a Linear's
  `weight` in float8 with `weight_scale` per output channel ([out, 1]) or per tensor; activations
  either unquantized or quantized dynamically per token at run time; modules named in `ignore`
  (names or `re:` patterns) stay in the checkpoint's dtype.
- block-wise (`quant_method: "fp8"` with `weight_block_size: [bm, bk]`, as the Qwen team's FP8
  releases): `weight` in float8 with `weight_scale_inv` [ceil(out / bm), ceil(in / bk)], each
  scale multiplying its bm x bk block (the last row and column of blocks may be partial).

On a GPU with FP8 tensor cores the language model's projections stay in FP8 as published
(`mmpipe.layers.fp8.Fp8Linear`: per-channel or 128 x 128 block scales, activations quantized
per token, or per token and 128 columns for block scales); `dequantized(keep=...)` passes their
weights through with their scales in the layer's layout (`Fp8Checkpoint.kernel_scale`). Every
other FP8 weight (the CPU, older GPUs, layers whose shape the FP8 kernels do not take) is
dequantized as it loads (weight * scale, then the run's dtype), with one log line saying so.
Anything else (other methods, integer or 4-bit weights, group scales, static activation scales,
an FP8 KV cache) is refused with a `CheckpointError` naming it, as is an FP8 weight whose scale
is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from mmpipe.errors import CheckpointError, InputError

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint's FP8 weights are stored (see the module docstring)."""

    method: str  # "compressed-tensors" or "fp8"
    scale_suffix: str  # the scale tensor beside each `weight`: "weight_scale" or "weight_scale_inv"
    strategy: str  # "channel", "tensor" or "block"
    block: tuple[int, int] | None = None  # block-wise: (rows, columns) per scale
    dynamic_activations: bool = False  # activations quantized per token at run time by the format
    ignore: tuple[str, ...] = ()  # modules left unquantized, as the config names them

    def describe(self) -> str:
        weights = f"{self.block[0]}x{self.block[1]} blocks" if self.block else f"per {self.strategy}"
        activations = "dynamic per-token FP8 activations" if self.dynamic_activations else "activations unquantized"
        return f"FP8 E4M3 weights ({self.method}, scales {weights}; {activations})"

    def kernel_scale(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`scale` in the layout of `Fp8Linear.weight_scale`: [N, 1] per channel (a per-tensor
        scale repeated), or the [ceil(N / 128), ceil(K / 128)] block grid with its columns padded
        to a multiple of 4 (`block_scale_columns`; the padding is never read)."""
        scale = scale.to(torch.float32)
        rows = weight.shape[0]
        if self.block is not None:
            self._check_grid(name, weight, scale)
            columns = -(-scale.shape[1] // 4) * 4
            return torch.cat([scale, scale.new_ones(scale.shape[0], columns - scale.shape[1])], 1)
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(rows, 1).contiguous()
        if scale.numel() != rows:
            raise CheckpointError(f"tensor {name!r}: a {tuple(weight.shape)} weight needs one scale per output "
                                  f"channel ({rows}), found {tuple(scale.shape)}")
        return scale.reshape(rows, 1).contiguous()

    def _check_grid(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
        rows, cols = self.block
        grid = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
        if tuple(scale.shape) != grid:
            raise CheckpointError(f"tensor {name!r}: a {tuple(weight.shape)} weight in {rows}x{cols} blocks needs "
                                  f"scales of shape {grid}, found {tuple(scale.shape)}")

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`weight` (float8, [out, in]) times its scales, in float32."""
        out = weight.to(torch.float32)
        scale = scale.to(torch.float32)
        if self.block is not None:
            rows, cols = self.block
            self._check_grid(name, out, scale)
            full = scale.repeat_interleave(rows, 0)[:out.shape[0]].repeat_interleave(cols, 1)[:, :out.shape[1]]
            return out * full
        if scale.numel() == 1:
            return out * scale.reshape(())
        if scale.numel() != out.shape[0]:
            raise CheckpointError(f"tensor {name!r}: a {tuple(out.shape)} weight needs one scale per output "
                                  f"channel ({out.shape[0]}), found {tuple(scale.shape)}")
        return out * scale.reshape(-1, 1)


def fp8_checkpoint(hf_config: dict[str, Any], path: str) -> Fp8Checkpoint | None:
    """The checkpoint's FP8 format, None when it is not quantized; a clear error for a
    quantization this loader does not read."""
    config = hf_config.get("quantization_config") or hf_config.get("text_config", {}).get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config, path)
    if method == "fp8":
        return _block_fp8(config, path)
    raise CheckpointError(f"{path}: quantization {method!r} is not supported (mmpipe reads FP8 checkpoints: "
                          "compressed-tensors float-quantized and block-wise 'fp8')")


def _compressed_tensors(config: dict[str, Any], path: str) -> Fp8Checkpoint:
    where = f"{path}: compressed-tensors quantization"
    if config.get("format") not in ("float-quantized", None):
        raise CheckpointError(f"{where}: format {config.get('format')!r} is not supported (only 'float-quantized' FP8)")
    if config.get("kv_cache_scheme"):
        raise CheckpointError(f"{where}: an FP8 KV cache (kv_cache_scheme) is not supported")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise CheckpointError(f"{where}: no config_groups")
    strategies, dynamic = set(), set()
    for group in groups:
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise CheckpointError(f"{where}: weights of type {weights.get('type')!r} with {weights.get('num_bits')} bits "
                                  "are not supported (only 8-bit float)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise CheckpointError(f"{where}: weight strategy {weights.get('strategy')!r} is not supported "
                                  "(only 'channel' and 'tensor')")
        if weights.get("dynamic") or weights.get("symmetric") is False:
            raise CheckpointError(f"{where}: dynamic or asymmetric weight scales are not supported")
        if any(target != "Linear" for target in group.get("targets", ["Linear"])):
            raise CheckpointError(f"{where}: targets {group.get('targets')} are not supported (only 'Linear')")
        activations = group.get("input_activations")
        if activations is not None:
            if activations.get("type") != "float" or activations.get("num_bits") != 8 or not activations.get("dynamic"):
                raise CheckpointError(f"{where}: input activations {activations.get('type')!r} "
                                      f"{activations.get('num_bits')}-bit, dynamic={activations.get('dynamic')}, are "
                                      "not supported (only dynamic FP8; static activation scales are not)")
        strategies.add(weights["strategy"])
        dynamic.add(activations is not None)
    if len(strategies) > 1 or len(dynamic) > 1:
        raise CheckpointError(f"{where}: config groups with different schemes are not supported")
    return Fp8Checkpoint("compressed-tensors", "weight_scale", strategies.pop(), None, dynamic.pop(),
                         tuple(config.get("ignore") or ()))


def _block_fp8(config: dict[str, Any], path: str) -> Fp8Checkpoint:
    where = f"{path}: fp8 quantization"
    if config.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: format {config.get('fmt')!r} is not supported (only e4m3)")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}: activation_scheme {config.get('activation_scheme')!r} is not supported "
                              "(only dynamic)")
    block = config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: weight_block_size {block!r} is not supported (two positive integers, "
                              "e.g. [128, 128])")
    return Fp8Checkpoint("fp8", "weight_scale_inv", "block", (block[0], block[1]), True,
                         tuple(config.get("modules_to_not_convert") or ()))


def dequantized(tensors: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Checkpoint | None, dtype: torch.dtype,
                path: str, keep: Callable[[str], bool] = lambda module: False
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight times its scale (its scale tensor consumed),
    floating tensors in `dtype`; the modules `keep` names (checkpoint names without `.weight`)
    instead give their FP8 weight and `<module>.weight_scale` in `Fp8Linear`'s layout. An FP8
    weight waits for its scale (and a scale for its weight) wherever in the files the other comes."""

    def pair(weight_name: str, weight: torch.Tensor, scale: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        module = weight_name[:-len(".weight")]
        if keep(module):
            yield weight_name, weight
            yield module + ".weight_scale", scheme.kernel_scale(weight_name, weight, scale)
        else:
            yield weight_name, scheme.dequantize(weight_name, weight, scale).to(dtype)

    weights: dict[str, tuple[str, torch.Tensor]] = {}  # module -> (weight's name, FP8 weight)
    scales: dict[str, torch.Tensor] = {}
    suffix = "." + scheme.scale_suffix if scheme is not None else None
    for name, tensor in tensors:
        if suffix is not None and name.endswith(suffix):
            module = name[:-len(suffix)]
            if module in weights:
                weight_name, weight = weights.pop(module)
                yield from pair(weight_name, weight, tensor)
            else:
                scales[module] = tensor
            continue
        if tensor.dtype == FP8:
            if scheme is None:
                raise CheckpointError(f"{path}: tensor {name!r} is FP8 but config.json has no quantization_config")
            if not name.endswith(".weight"):
                raise CheckpointError(f"{path}: tensor {name!r} is FP8; only Linear weights may be")
            module = name[:-len(".weight")]
            if module in scales:
                yield from pair(name, tensor, scales.pop(module))
            else:
                weights[module] = (name, tensor)
            continue
        yield name, tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor
    if weights:
        names = sorted(name for name, _ in weights.values())
        raise CheckpointError(f"{path}: {len(names)} FP8 weight(s) without their {scheme.scale_suffix}: "
                              f"{', '.join(names[:10])}")
    if scales:
        raise CheckpointError(f"{path}: {len(scales)} {scheme.scale_suffix} tensor(s) without an FP8 weight: "
                              f"{', '.join(sorted(scales)[:10])}")


# Quantizations applied at load (`EngineConfig.quantization`), and the language model's layers they cover.
# "fp8" covers the language model's projections; "fp8-all" the vision tower's linear layers too
# (attention, MLP and the patch merger's; not the patch embedding, whose width cuBLASLt's FP8 GEMM
# does not take at 14 px patches).
RUNTIME_QUANTIZATIONS = ("fp8", "fp8-all")
LM_FP8_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
VISION_FP8_LAYERS = ("qkv", "proj", "gate_up_proj", "down_proj", "fc1", "fc2")
QUANTIZATION_HELP = ("fp8: the language model's linear layers in FP8; fp8-all: the vision tower's too (both need "
                     "compute capability 8.9+: Ada or Hopper GPUs). FP8 checkpoints are read as published without it")


def check_runtime_quantization(name: str | None, device: torch.device) -> str | None:
    """`name` normalised (None for none), or an `InputError` naming what is wrong: an unknown
    scheme, or FP8 on a device without FP8 tensor cores."""
    if name is None or name == "none":
        return None
    if name not in RUNTIME_QUANTIZATIONS:
        raise InputError(f"quantization={name!r}: use 'fp8' (the language model), 'fp8-all' (the vision tower "
                         "too) or None")
    from mmpipe.layers.fp8 import fp8_available

    if not fp8_available(device):
        where = device.type if device.type != "cuda" else \
            f"{torch.cuda.get_device_name(device)} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
        raise InputError(f"quantization={name!r} needs a GPU with FP8 tensor cores (CUDA compute capability 8.9 or "
                         f"higher: Ada, Hopper and later); this run's device is {where}. FP8 checkpoints still "
                         "load anywhere, dequantized to the run's dtype")
    return name
