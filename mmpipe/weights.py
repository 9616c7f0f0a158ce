"""Loading a local Hugging Face checkpoint's safetensors into mmpipe's models.

Single or sharded files (with `model.safetensors.index.json`), read straight onto the target
device and cast to the target dtype one tensor at a time. Both naming layouts that exist are
accepted: `model.visual.*` / `model.language_model.*` (transformers 5 in memory) and
`visual.*` / `model.*` (the published Qwen2.5-VL files). Missing and unexpected tensors are
reported together, by name; a mis-shaped or duplicated tensor stops loading at once, by name.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from mmpipe.errors import CheckpointError
from mmpipe.layers.fp8 import BLOCK, Fp8Linear, block_scale_columns, fp8_shape_ok
from mmpipe.layers.fp8_experts import Fp8Experts, fits
from mmpipe.layers.parallel import NOTHING, Slice
from mmpipe.layers.weight_map import WeightMap
from mmpipe.quantization import Fp8Checkpoint, dequantized

# Checkpoint prefix -> (component, prefix of the name inside the component). First match wins.
_LAYOUTS: tuple[tuple[str, str, str], ...] = (
    ("model.visual.", "vision", ""),
    ("visual.", "vision", ""),
    ("model.language_model.", "language", ""),
    ("language_model.model.", "language", ""),
    ("model.", "language", ""),
    ("lm_head.", "language", "lm_head."),
    ("language_model.lm_head.", "language", "lm_head."),
)


def read_json(directory: str, name: str, required: bool = True) -> dict[str, Any] | None:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        if required:
            raise CheckpointError(f"{directory}: missing {name}")
        return None
    try:
        with open(path) as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint, from the shard index when there is one."""
    index = read_json(directory, "model.safetensors.index.json", required=False)
    if index is not None:
        names = sorted(set(index.get("weight_map", {}).values()))
        if not names:
            raise CheckpointError(f"{directory}: model.safetensors.index.json has an empty weight_map")
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise CheckpointError(f"{directory}: shards listed in the index are missing: {', '.join(missing)}")
        return [os.path.join(directory, n) for n in names]
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no *.safetensors weights (other formats are not supported)")
    return [os.path.join(directory, f) for f in found]


def split_name(name: str) -> tuple[str, str] | None:
    """Checkpoint tensor name -> (component, name within the component), or None if unknown."""
    for prefix, component, inner in _LAYOUTS:
        if name.startswith(prefix):
            return component, inner + name[len(prefix):]
    return None


def iter_checkpoint(directory: str, device: torch.device, dtype: torch.dtype, fp8: Fp8Checkpoint | None = None,
                    keep: frozenset[str] = frozenset(), select: Callable[[str], Slice | None] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, on `device`, floating tensors cast to `dtype`; FP8
    weights times their scales (`mmpipe.quantization.dequantized`), except those of the modules in
    `keep` (checkpoint names without `.weight`), which stay FP8 beside their scales. `select`:
    the part of a tensor to read (a tensor-parallel rank's `Slice`), None for all of it, or
    `NOTHING` for a tensor the rank does not hold (another rank's expert, not read); only
    that part is read from the file (an FP8 checkpoint's tensors are read whole, then cut: a
    dequantized weight after its scales were applied, a kept one with its scales, `_cut_scale`)."""
    if fp8 is None:
        return dequantized(_raw_tensors(directory, device, select), fp8, dtype, directory, keep.__contains__)
    def held_whole(name: str) -> Slice | None:  # read whole, but not at all what the rank does not hold
        weight = name.removesuffix("_" + fp8.scale_suffix.removeprefix("weight_"))
        return NOTHING if select is not None and select(weight) is NOTHING else None

    tensors = dequantized(_raw_tensors(directory, device, held_whole), fp8, dtype, directory, keep.__contains__)
    if select is None:
        return tensors
    return ((n, _cut_scale(select, n, t, fp8) if n[:-len(".weight_scale")] in keep and n.endswith(".weight_scale")
             else _cut(select(n), t)) for n, t in tensors)


def _cut(part: Slice | None, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if part is None else part.of(tensor)


def _cut_scale(select: Callable[[str], Slice | None], name: str, scale: torch.Tensor, fp8: Fp8Checkpoint
               ) -> torch.Tensor:
    """A kept FP8 layer's scale (`Fp8Linear`'s layout) cut with its weight: per channel, the rows
    of a row split (a column split keeps every output channel's scale); 128 x 128 blocks, the
    tiles of the weight's part (`place_fp8_layers` keeps only parts on tile boundaries), the
    columns padded again to `block_scale_columns`."""
    part = select(name[:-len("_scale")])  # the weight's part
    if part is None:
        return scale
    if fp8.block is None:
        return part.of(scale) if part.dim == 0 else scale
    if part.start % BLOCK or part.length != part.stop - part.start:
        raise CheckpointError(f"tensor {name!r}: a tensor-parallel part [{part.start}, {part.stop}) does not fall on "
                              f"{BLOCK}-wide scale blocks")
    tiles = Slice(part.dim, part.start // BLOCK, -(-part.stop // BLOCK), -(-part.length // BLOCK)).of(scale)
    if part.dim == 1:
        columns = block_scale_columns(part.length)
        tiles = torch.cat([tiles, tiles.new_ones(tiles.shape[0], columns - tiles.shape[1])], 1)
    return tiles.contiguous()


def stored_fp8_modules(directory: str) -> set[str]:
    """Checkpoint module names whose `weight` is stored in FP8 E4M3 (from the files' headers)."""
    found: set[str] = set()
    for path in checkpoint_files(directory):
        try:
            with safe_open(path, framework="pt") as handle:
                found.update(name[:-len(".weight")] for name in handle.keys()
                             if name.endswith(".weight") and handle.get_slice(name).get_dtype() == "F8_E4M3")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from exc
    return found


def place_fp8_layers(component: str, module: nn.Module, names: tuple[str, ...], stored: set[str],
                     scheme: Fp8Checkpoint) -> tuple[set[str], int]:
    """Before `materialize` (on the meta device, dtype set): replace each `nn.Linear` of `module`
    named in `names` whose checkpoint weights are all stored in FP8 (`stored`) and whose shape
    the FP8 kernels take by an empty `Fp8Linear` to load them into as published. Returns the
    checkpoint module names kept in FP8 and how many layers could not be (dequantized instead)."""
    wmap: WeightMap = module.weight_map()
    prefixes = [prefix for prefix, comp, inner in _LAYOUTS if comp == component and not inner]
    kept: set[str] = set()
    refused = 0
    for path, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if name not in names or not isinstance(child, nn.Linear):
                continue
            param = f"{path}.{name}.weight" if path else f"{name}.weight"
            sources = [(source[:-len(".weight")], rows) for source, rows in wmap.sources(param)]
            full = {source: [p + source for p in prefixes] for source, _ in sources}
            if not all(any(n in stored for n in full[source]) for source, _ in sources):
                continue  # left in the run's dtype by the checkpoint (an `ignore` list)
            if not _fp8_layer_fits(child, [rows for _, rows in sources], scheme):
                refused += 1
                continue
            setattr(parent, name, Fp8Linear.empty(child.out_features, child.in_features, child.bias is not None,
                                                  child.weight.dtype, scheme.block is not None))
            kept.update(n for candidates in full.values() for n in candidates if n in stored)
    return kept, refused


def place_fp8_experts(component: str, module: nn.Module, stored: set[str], scheme: Fp8Checkpoint
                      ) -> tuple[set[str], int]:
    """As `place_fp8_layers`, for experts stored one tensor per expert and projection (the Qwen
    team's FP8 releases): each experts module (a child `experts` with 3D `gate_up_proj` and
    `down_proj`) whose every expert's gate, up and down weights are stored in FP8 in 128 x 128
    blocks, and whose shape is made of whole blocks, becomes an empty `Fp8Experts`. Returns the
    checkpoint module names kept in FP8 and how many layers could not be (dequantized instead)."""
    prefixes = [prefix for prefix, comp, inner in _LAYOUTS if comp == component and not inner]
    kept: set[str] = set()
    refused = 0
    for path, parent in list(module.named_modules()):
        child = getattr(parent, "experts", None)
        down = getattr(child, "down_proj", None)
        if not isinstance(child, nn.Module) or isinstance(child, Fp8Experts) or getattr(down, "dim", lambda: 0)() != 3:
            continue
        experts, hidden, width = down.shape
        first = getattr(parent, "expert_offset", None) or 0  # expert parallelism: this rank's experts
        inner = f"{path}.experts" if path else "experts"
        names = [f"{prefix}{inner}.{e}.{proj}" for e in range(first, first + experts)
                 for proj in ("gate_proj", "up_proj", "down_proj") for prefix in prefixes]
        found = [name for name in names if name in stored]
        if len(found) != 3 * experts:
            continue  # stored as 3D tensors, or left in the run's dtype by the checkpoint
        if scheme.block != (BLOCK, BLOCK) or not fits(hidden, width):
            refused += 1
            continue
        parent.experts = Fp8Experts(experts, hidden, width)
        kept.update(found)
    return kept, refused


def _fp8_layer_fits(linear: nn.Linear, part_rows: list[int], scheme: Fp8Checkpoint) -> bool:
    """Whether the FP8 kernels take this layer as stored: dimensions cuBLASLt's FP8 GEMM takes and,
    for block scales, 128 x 128 blocks that the fused parts' rows and the input width align with."""
    if not fp8_shape_ok(linear):
        return False
    if scheme.block is None:
        return True
    return (scheme.block == (BLOCK, BLOCK) and linear.in_features % BLOCK == 0
            and all(rows % BLOCK == 0 for rows in part_rows[:-1]))


def _raw_tensors(directory: str, device: torch.device, select: Callable[[str], Slice | None] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    target = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    for path in checkpoint_files(directory):
        try:
            handle = safe_open(path, framework="pt", device=target)
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from exc
        with handle:
            for name in handle.keys():
                part = select(name) if select is not None else None
                if part is NOTHING:  # another rank's (an expert it does not hold)
                    continue
                if part is None:
                    yield name, handle.get_tensor(name)
                    continue
                yield name, part.read(handle.get_slice(name))


def load_checkpoint(directory: str, components: dict[str, nn.Module], device: torch.device,
                    dtype: torch.dtype, fp8: Fp8Checkpoint | None = None, keep: frozenset[str] = frozenset(),
                    slices: dict[str, Callable[[str], Slice | None]] | None = None) -> None:
    """Fill every component's parameters from the checkpoint (the FP8 modules in `keep` into
    their `Fp8Linear` layers, `place_fp8_layers`); raise listing every problem. `slices`: per
    component, the part of each of its tensors this process holds (a tensor-parallel shard,
    `ModelSpec.shard_slices`; names inside the component), read alone from the files."""
    maps = {name: module.weight_map() for name, module in components.items()}
    loaded: dict[str, set[str]] = {name: set() for name in components}
    unexpected: list[str] = []
    seen: set[str] = set()

    def select(name: str) -> Slice | None:
        split = split_name(name)
        rule = slices.get(split[0]) if split is not None and slices else None
        return rule(split[1]) if rule is not None else None

    for name, tensor in iter_checkpoint(directory, device, dtype, fp8, keep, select if slices else None):
        if name in seen:
            raise CheckpointError(f"{directory}: tensor {name!r} appears in more than one shard")
        seen.add(name)
        split = split_name(name)
        if split is None or split[0] not in maps:
            unexpected.append(name)
            continue
        component, inner = split
        module = components[component]
        if inner in getattr(module, "optional_weight_names", lambda: set())():
            continue
        got, extra = maps[component].load([(inner, tensor)])
        loaded[component] |= got
        unexpected.extend(name for _ in extra)
    missing = sorted(f"{component}: {n}" for component, wmap in maps.items()
                     for n in wmap.expected_names() - loaded[component])
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_list(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_list(sorted(unexpected))}")
    if problems:
        raise CheckpointError(f"{directory}: weights do not match the model: " + "; ".join(problems))


def _list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def prepare_for_kernels(module: nn.Module) -> nn.Module:
    """After loading: give weights the layout the kernels run fastest with (zero padding that
    leaves every result unchanged, see `GatedMLP.pad_width`)."""
    for sub in module.modules():
        if hasattr(sub, "pad_width"):
            sub.pad_width()
    return module


def allocate(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device=device)` without `torch.empty_like`: on meta tensors that runs
    PyTorch's Python reference implementation, whose first call imports sympy (seconds of every
    process's start-up). A parameter or buffer shared
    by several modules (tied embeddings) stays one object."""
    made: dict[int, torch.Tensor] = {}

    def real(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            new = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            made[id(tensor)] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        return made[id(tensor)]

    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = real(tensor)


def materialize(module: nn.Module, device: torch.device, dtype: torch.dtype,
                before_storage: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Give a module built on the meta device real (uninitialised) storage, then rebuild the
    derived buffers (rotary tables) that are computed rather than loaded. `before_storage` runs
    on the meta module once its dtype is set (`place_fp8_layers`: FP8 layers keep their dtypes)."""
    module = module.to(dtype=dtype)
    if before_storage is not None:
        before_storage(module)
    allocate(module, device)
    for sub in module.modules():
        if hasattr(sub, "init_buffers"):
            sub.init_buffers()
    return module.eval().requires_grad_(False)


def fill_random(components: dict[str, nn.Module], seed: int = 0, std: float = 0.02) -> None:
    """`load_format="dummy"`: every parameter drawn on its device instead of read. Norm scales
    are one and biases zero (as a trained model's are near); routers of experts (`.mlp.gate`) are
    drawn wide enough that rows spread over many experts with clear choices, so timing reads
    what routing in a real model reads; every other matrix ~ N(0, std)."""
    for name, module in components.items():
        generator: torch.Generator | None = None
        for pname, param in module.named_parameters():
            if generator is None or generator.device != param.device:
                generator = torch.Generator(device=param.device).manual_seed(seed + len(name))
            owner = pname.rsplit(".", 2)[-2]
            if param.dim() == 1:
                norm_scale = pname.endswith("weight") and ("norm" in owner or owner.startswith("ln"))
                param.data.fill_(1.0 if norm_scale else 0.0)
            elif pname.endswith(".mlp.gate.weight"):
                param.data.normal_(0.0, 2.0 / param.shape[1] ** 0.5, generator=generator)
            else:
                param.data.normal_(0.0, std, generator=generator)
