"""FP8 checkpoints as published, on the CPU: tiny checkpoints written by the tests in each format
(compressed-tensors per channel and per tensor, block-wise `fp8` with non-uniform block scales)
load into the same model as their weights dequantized by hand (float32 logits within 1e-4,
greedy tokens identical), and differ from the unquantized originals (the FP8 rounding is really
there); block scales land on the right tiles; unsupported schemes and missing scales are refused
by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmpipe import Pipeline, SamplingParams
from mmpipe.errors import CheckpointError
from mmpipe.quantization import FP8, Fp8Checkpoint, fp8_checkpoint
from tests.helpers import first_logits, make_checkpoint, random_image, rel_err

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(max_new_tokens=12)


def _is_lm_linear(name: str) -> bool:
    return "visual" not in name and name.endswith(".weight") and any(f".{k}." in name for k in LINEARS)


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.finfo(FP8).max
    return (w / scale).to(FP8), scale.to(torch.float32)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().max().clamp(min=1e-12) / torch.finfo(FP8).max).reshape(1)
    return (w / scale).to(FP8), scale.to(torch.float32)


def quantize_blocks(w: torch.Tensor, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 blocks with deliberately uneven scales (each block's own range times a random factor),
    so a scale applied to the wrong tile changes the result."""
    grid = (-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    g = torch.Generator().manual_seed(seed)
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / torch.finfo(FP8).max * (1 + 3 * torch.rand((), generator=g))
    full = scale.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(cols, 1)[:, :w.shape[1]]
    return (w / full).to(FP8), scale


def _write(source: str, target: str, tensors: dict[str, torch.Tensor], quantization: dict | None) -> str:
    shutil.copytree(source, target)
    os.remove(os.path.join(target, "model.safetensors"))
    save_file(tensors, os.path.join(target, "model.safetensors"))
    config_path = os.path.join(target, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    if quantization is not None:
        config["quantization_config"] = quantization
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    return target


def fp8_pair(base: str, tmp, fmt: str, block: tuple[int, int] = (128, 64), unquantized: tuple[str, ...] = ()
             ) -> tuple[str, str]:
    """(the checkpoint in `fmt`, the same weights dequantized by hand in float32). The modules
    named in `unquantized` are stored in bfloat16 and listed in the config's ignore list, as a
    quantizer leaves the layers it was told to skip."""
    rows, cols = block
    original = load_file(os.path.join(base, "model.safetensors"))
    stored, by_hand = {}, {}
    for k, (name, w) in enumerate(sorted(original.items())):
        if name.removesuffix(".weight") in unquantized:
            stored[name] = w.to(torch.bfloat16)
            by_hand[name] = stored[name].float()
            continue
        if not _is_lm_linear(name):
            stored[name] = by_hand[name] = w
            continue
        if fmt == "block":
            q, scale = quantize_blocks(w.float(), rows, cols, seed=k)
            full = scale.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(cols, 1)[:, :w.shape[1]]
            stored[name], stored[name + "_scale_inv"] = q, scale
            by_hand[name] = q.float() * full
        else:
            q, scale = (quantize_channel if fmt == "channel" else quantize_tensor)(w.float())
            stored[name], stored[name + "_scale"] = q, scale
            by_hand[name] = q.float() * (scale.reshape(-1, 1) if fmt == "channel" else scale)
    if fmt == "block":
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [rows, cols], "modules_to_not_convert": ["lm_head", "visual", *unquantized]}
    else:
        config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                  "config_groups": {"group_0": {
                      "targets": ["Linear"],
                      "weights": {"num_bits": 8, "type": "float", "strategy": fmt, "dynamic": False, "symmetric": True},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                            "symmetric": True}}},
                  "ignore": ["lm_head", "re:.*visual.*", *unquantized]}
    name = f"{fmt}_{rows}x{cols}" + ("_partly" if unquantized else "")
    quantized = _write(base, str(tmp / f"fp8_{name}"), stored, config)
    reference = _write(base, str(tmp / f"by_hand_{name}"), by_hand, None)
    return quantized, reference


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # Widths that are not multiples of the 128x64 blocks: partial blocks on both edges.
    return make_checkpoint(str(tmp_path_factory.mktemp("base")), text={"intermediate_size": 200})


def _chat() -> list:
    return [{"role": "user", "content": [{"type": "image", "image": random_image(96, 80, seed=4)},
                                         {"type": "text", "text": "Describe this image."}]}]


@pytest.mark.parametrize("fmt", ["channel", "tensor", "block"])
def test_a_published_fp8_checkpoint_equals_its_weights_dequantized_by_hand(base, tmp_path, fmt):
    quantized, reference = fp8_pair(base, tmp_path, fmt)
    fp8_pipe = Pipeline.from_pretrained(quantized, device="cpu", dtype="float32")
    by_hand = Pipeline.from_pretrained(reference, device="cpu", dtype="float32")
    original = Pipeline.from_pretrained(base, device="cpu", dtype="float32")
    ours, want = first_logits(fp8_pipe, _chat()), first_logits(by_hand, _chat())
    assert rel_err(ours, want) <= 1e-4
    assert rel_err(want, first_logits(original, _chat())) > 1e-3  # FP8 rounding really changed the weights
    assert [o.token_ids for o in fp8_pipe.chat([_chat()], GREEDY)] == [o.token_ids for o in by_hand.chat([_chat()], GREEDY)]
    assert fp8_pipe.model.quantization.startswith("FP8 E4M3 weights")
    assert original.model.quantization is None


def test_block_scales_multiply_their_own_tiles():
    """A 5x3 grid of distinct scales on a 300x130 weight in 64x48 blocks (partial last row and
    column): each element is scaled by the block it sits in; a transposed or swapped grid fails."""
    scheme = Fp8Checkpoint("fp8", "weight_scale_inv", "block", (64, 48))
    weight = torch.randn(300, 130).to(FP8)
    scale = torch.arange(1.0, 16.0).reshape(5, 3)
    out = scheme.dequantize("w", weight, scale)
    for i in (0, 63, 64, 255, 256, 299):
        for j in (0, 47, 48, 95, 96, 129):
            assert out[i, j] == weight[i, j].float() * scale[i // 64, j // 48]
    with pytest.raises(CheckpointError, match=r"'w': a \(300, 130\) weight in 64x48 blocks needs scales of shape \(5, 3\)"):
        scheme.dequantize("w", weight, scale.t().contiguous())


def test_channel_scales_follow_output_rows():
    scheme = Fp8Checkpoint("compressed-tensors", "weight_scale", "channel")
    weight = torch.randn(4, 6).to(FP8)
    scale = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert torch.equal(scheme.dequantize("w", weight, scale), weight.float() * scale)
    with pytest.raises(CheckpointError, match="one scale per output channel"):
        scheme.dequantize("w", weight, torch.ones(6))


def test_a_missing_scale_is_refused_by_name(base, tmp_path):
    quantized, _ = fp8_pair(base, tmp_path, "channel")
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    gone = next(n for n in sorted(tensors) if n.endswith("q_proj.weight_scale"))
    del tensors[gone]
    save_file(tensors, os.path.join(quantized, "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"1 FP8 weight\(s\) without their weight_scale: {gone[:-len('_scale')]}"):
        Pipeline.from_pretrained(quantized, device="cpu")


def test_fp8_weights_without_a_quantization_config_are_refused(base, tmp_path):
    quantized, _ = fp8_pair(base, tmp_path, "channel")
    with open(os.path.join(quantized, "config.json")) as handle:
        config = json.load(handle)
    del config["quantization_config"]
    with open(os.path.join(quantized, "config.json"), "w") as handle:
        json.dump(config, handle)
    with pytest.raises(CheckpointError, match="is FP8 but config.json has no quantization_config"):
        Pipeline.from_pretrained(quantized, device="cpu")


CT = {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"],
                              "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}


def _ct(**weights) -> dict:
    return {**CT, "config_groups": {"g": {**CT["config_groups"]["g"],
                                          "weights": {**CT["config_groups"]["g"]["weights"], **weights}}}}


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4}, "quantization 'awq' is not supported"),
    ({"quant_method": "gptq"}, "quantization 'gptq' is not supported"),
    ({**CT, "format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
    (_ct(type="int"), "weights of type 'int' with 8 bits are not supported"),
    (_ct(num_bits=4), "weights of type 'float' with 4 bits"),
    (_ct(strategy="group", group_size=128), "weight strategy 'group' is not supported"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8}}, "an FP8 KV cache"),
    ({**CT, "config_groups": {"g": {**CT["config_groups"]["g"], "input_activations":
      {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}, "static activation scales"),
    ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size None is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme 'static' is not supported"),
])
def test_unsupported_schemes_are_refused_by_name(config, message):
    with pytest.raises(CheckpointError, match=message):
        fp8_checkpoint({"quantization_config": config}, "ckpt")


def test_supported_schemes_are_read():
    assert fp8_checkpoint({}, "ckpt") is None
    channel = fp8_checkpoint({"quantization_config": CT}, "ckpt")
    assert (channel.strategy, channel.scale_suffix, channel.dynamic_activations) == ("channel", "weight_scale", False)
    block = fp8_checkpoint({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "ckpt")
    assert (block.block, block.scale_suffix) == ((128, 128), "weight_scale_inv")


def test_a_scale_may_come_before_its_weight_in_the_files():
    from mmpipe.quantization import dequantized

    scheme = Fp8Checkpoint("compressed-tensors", "weight_scale", "channel")
    weight = torch.randn(3, 5).to(FP8)
    scale = torch.tensor([[0.5], [2.0], [4.0]])
    want = weight.float() * scale
    for order in ([("a.weight", weight), ("a.weight_scale", scale)], [("a.weight_scale", scale), ("a.weight", weight)]):
        got = dict(dequantized(order + [("b.bias", torch.ones(2, dtype=torch.float64))], scheme, torch.float32, "ckpt"))
        assert torch.equal(got["a.weight"], want) and got["b.bias"].dtype == torch.float32
        assert set(got) == {"a.weight", "b.bias"}  # the scale is consumed, not a tensor of its own


# ---------------------------------------------------------------------------- kept in FP8
# On a GPU with FP8 tensor cores the language model's projections stay FP8 as published. The same
# loading runs on the CPU with `keep_fp8=True` (the products then run in float32 on the
# quantized values: `Fp8Linear`'s reference path).

KEEP_TEXT = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Widths the FP8 kernels take: every fused part and input a multiple of 128."""
    return make_checkpoint(str(tmp_path_factory.mktemp("wide")), text=KEEP_TEXT)


def _load(path: str, keep: bool):
    from mmpipe.models import load_model

    return load_model(path, torch.device("cpu"), torch.float32, keep_fp8=keep)


@pytest.mark.parametrize("fmt", ["channel", "tensor", "block"])
def test_fp8_layers_hold_the_published_weights(wide, tmp_path, fmt):
    """Each FP8 layer (q/k/v and gate/up fused) holds the published FP8 values and scales: its
    dequantized weight equals the by-hand dequantization exactly, fused parts in their order and
    non-uniform block scales on their own tiles."""
    from mmpipe.layers.fp8 import Fp8Linear

    quantized, reference = fp8_pair(wide, tmp_path, fmt, block=(128, 128))
    kept, by_hand = _load(quantized, True), _load(reference, False)
    layers = {name: m for name, m in kept.language.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down in both layers
    assert all(m.block == (fmt == "block") for m in layers.values())
    for name, layer in layers.items():
        want = by_hand.language.get_submodule(name).weight
        assert torch.equal(layer.dequantized_weight(), want), name
    assert "8 language-model linear layers kept in FP8" in kept.quantization
    assert not any(isinstance(m, Fp8Linear) for m in by_hand.language.modules())


@pytest.mark.parametrize("fmt", ["channel", "block"])
def test_an_fp8_checkpoint_runs_on_its_fp8_layers(wide, tmp_path, monkeypatch, fmt):
    """End to end with the layers kept in FP8 (the CPU standing in for an FP8 GPU): logits within
    the dynamic activation quantization's error of the by-hand dequantized model, and not equal
    to them (the activations really are quantized)."""
    import mmpipe.models

    quantized, reference = fp8_pair(wide, tmp_path, fmt, block=(128, 128))
    monkeypatch.setattr(mmpipe.models, "fp8_available", lambda device: True)
    kept = Pipeline.from_pretrained(quantized, device="cpu", dtype="float32")
    monkeypatch.undo()
    by_hand = Pipeline.from_pretrained(reference, device="cpu", dtype="float32")
    assert "kept in FP8" in kept.model.quantization
    ours, want = first_logits(kept, _chat()), first_logits(by_hand, _chat())
    assert 1e-5 < rel_err(ours, want) < 0.1  # a random tiny model: ~4% from 8-bit activations


@pytest.mark.parametrize("fmt", ["channel", "block"])
def test_a_fused_layer_with_an_ignored_part_stays_unquantized_and_computes_its_twins_output(
        wide, tmp_path, monkeypatch, fmt):
    """The loader's rule for a fused projection: it stays FP8 only when every part is stored in
    FP8. Layer 0's q_proj left in bfloat16 by the checkpoint's ignore list (its k_proj and v_proj
    FP8): layer 0's qkv loads as a plain layer holding q as stored and k, v dequantized, every
    other projection stays FP8, and the fused layer computes exactly what its by-hand dequantized
    twin computes; dequantized everywhere (no FP8 tensor cores), the whole model does too."""
    import mmpipe.models
    from mmpipe.layers.fp8 import Fp8Linear

    ignored = "model.layers.0.self_attn.q_proj"
    quantized, reference = fp8_pair(wide, tmp_path, fmt, block=(128, 128), unquantized=(ignored,))
    twin = _load(reference, False).language
    kept = _load(quantized, True)
    layers = {name for name, m in kept.language.named_modules() if isinstance(m, Fp8Linear)}
    assert layers == {f"layers.{i}.{p}" for i in (0, 1) for p in ("self_attn.o_proj", "mlp.gate_up_proj",
                                                                  "mlp.down_proj")} | {"layers.1.self_attn.qkv_proj"}
    assert "7 language-model linear layers kept in FP8" in kept.quantization
    fused, want = kept.language.layers[0].self_attn.qkv_proj, twin.layers[0].self_attn.qkv_proj
    assert type(fused) is torch.nn.Linear and fused.weight.dtype == torch.float32
    assert torch.equal(fused.weight, want.weight) and torch.equal(fused.bias, want.bias)
    assert torch.equal(fused.weight[:256], load_file(os.path.join(quantized, "model.safetensors"))[
        ignored + ".weight"].float())  # q as stored, in bfloat16, not rounded to FP8
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fused(x), want(x))

    monkeypatch.setattr(mmpipe.models, "fp8_available", lambda device: False)
    dequantized = Pipeline.from_pretrained(quantized, device="cpu", dtype="float32")
    by_hand = Pipeline.from_pretrained(reference, device="cpu", dtype="float32")
    assert torch.equal(first_logits(dequantized, _chat()), first_logits(by_hand, _chat()))


def test_layers_the_fp8_kernels_cannot_take_are_dequantized(base, tmp_path):
    """128x64 blocks and widths that are not multiples of 128: every FP8 weight is dequantized,
    and the model says why."""
    from mmpipe.layers.fp8 import Fp8Linear

    quantized, _ = fp8_pair(base, tmp_path, "block")
    kept = _load(quantized, True)
    assert not any(isinstance(m, Fp8Linear) for m in kept.language.modules())
    assert "dequantized to float32 at load (shapes the FP8 kernels do not take)" in kept.quantization


def test_kernel_scales_take_the_layers_layout():
    scheme = Fp8Checkpoint("fp8", "weight_scale_inv", "block", (128, 128))
    weight = torch.randn(300, 600).to(FP8)
    grid = torch.arange(1.0, 16.0).reshape(3, 5)
    padded = scheme.kernel_scale("w", weight, grid)
    assert padded.shape == (3, 8) and torch.equal(padded[:, :5], grid)  # columns to a multiple of 4
    tensor = Fp8Checkpoint("compressed-tensors", "weight_scale", "tensor")
    assert torch.equal(tensor.kernel_scale("w", weight, torch.tensor([2.5])), torch.full((300, 1), 2.5))
    with pytest.raises(CheckpointError, match="needs scales of shape"):
        scheme.kernel_scale("w", weight, grid.t())


# A tensor-parallel rank keeps its part of each FP8 layer: 2 heads of 128 (one per rank), 2 KV
# heads, an MLP of 512 (256 per rank), so every part falls on 128 x 128 tiles.
TP_TEXT = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 24, 24]}}


@pytest.mark.parametrize("fmt", ["channel", "block"])
def test_a_tensor_parallel_rank_keeps_its_part_of_each_fp8_layer(tmp_path_factory, tmp_path, fmt):
    """`load_model(..., tp=TPGroup(r, 2))` on an FP8 checkpoint: every projection stays FP8, and
    each rank's layer dequantizes to exactly its part of the by-hand dequantized weights (the
    non-uniform block scales cut with their tiles: a column split's scale columns, a row split's
    scale rows; per-channel scales of a column split kept whole)."""
    from mmpipe.language.tensor_parallel import TPGroup, shard_language_model

    from mmpipe.layers.fp8 import Fp8Linear
    from mmpipe.models import load_model

    base = make_checkpoint(str(tmp_path_factory.mktemp("tp_wide")), text=TP_TEXT)
    quantized, reference = fp8_pair(base, tmp_path, fmt, block=(128, 128))
    cpu = torch.device("cpu")
    for rank in range(2):
        ours = load_model(quantized, cpu, torch.float32, keep_fp8=True, tp=TPGroup(rank, 2)).language
        want = shard_language_model(load_model(reference, cpu, torch.float32).language, TPGroup(rank, 2))
        layers = {name: m for name, m in ours.named_modules() if isinstance(m, Fp8Linear)}
        assert len(layers) == 4 * 2, sorted(layers)
        for name, layer in layers.items():
            assert torch.equal(layer.dequantized_weight(), want.get_submodule(name).weight), (rank, name)


def test_an_fp8_mlp_padded_for_the_kernels_stays_fp8_and_gives_the_same_output():
    """`GatedMLP.pad_width` on per-channel FP8 layers (a rank's width of 96, padded to 128): the
    layers stay FP8, the gate and up rows land at the start of their padded blocks with their
    scales (padding: zero rows, scale 1), and the output is bit-identical to the unpadded MLP's
    (zero columns do not move the per-token activation scales)."""
    from torch import nn

    from mmpipe.layers.fp8 import Fp8Linear
    from mmpipe.layers.mlp import GatedMLP

    gen = torch.Generator().manual_seed(3)
    mlp = GatedMLP(64, 96, "silu", bias=True)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    mlp.gate_up_proj = Fp8Linear.from_linear(mlp.gate_up_proj)
    mlp.down_proj = Fp8Linear.from_linear(mlp.down_proj)
    mlp.gate_up_proj.weight_scale.mul_(torch.linspace(0.5, 2.0, 192).unsqueeze(1))  # uneven per-row scales
    x = torch.randn(5, 64, generator=gen)
    before, gate_up = mlp(x), mlp.gate_up_proj.dequantized_weight()
    mlp.pad_width(64)
    assert mlp.hidden == 128 and isinstance(mlp.gate_up_proj, Fp8Linear) and isinstance(mlp.down_proj, Fp8Linear)
    assert not any(isinstance(m, nn.Linear) for m in mlp.modules())
    padded = mlp.gate_up_proj.dequantized_weight()
    for block in (0, 1):
        assert torch.equal(padded[block * 128: block * 128 + 96], gate_up[block * 96:(block + 1) * 96])
        assert not padded[block * 128 + 96:(block + 1) * 128].any()
    assert mlp.down_proj.in_features == 128 and tuple(mlp.down_proj.weight.shape) == (64, 128)
    assert torch.equal(mlp(x), before)


def test_a_tensor_parallel_rank_pads_its_fp8_mlp_part_for_the_kernels(tmp_path_factory, tmp_path):
    """A per-channel FP8 checkpoint whose MLP width, split over 2 ranks, is no multiple of the
    kernels' 64 (as Qwen2.5-VL-72B's 29568 at TP=4): each rank loads, keeps its MLP in FP8, padded,
    holding exactly its part of the by-hand dequantized weights."""
    from mmpipe.language.tensor_parallel import TPGroup, shard_language_model

    from mmpipe.layers.fp8 import Fp8Linear
    from mmpipe.models import load_model

    base = make_checkpoint(str(tmp_path_factory.mktemp("tp_192")), text=dict(TP_TEXT, intermediate_size=192))
    quantized, reference = fp8_pair(base, tmp_path, "channel")
    cpu = torch.device("cpu")
    for rank in range(2):
        ours = load_model(quantized, cpu, torch.float32, keep_fp8=True, tp=TPGroup(rank, 2)).language
        want = shard_language_model(load_model(reference, cpu, torch.float32).language, TPGroup(rank, 2))
        for layer, reference_layer in zip(ours.layers, want.layers):
            mlp = layer.mlp
            assert mlp.hidden == 128 and isinstance(mlp.gate_up_proj, Fp8Linear)
            gate_up, part = mlp.gate_up_proj.dequantized_weight(), reference_layer.mlp.gate_up_proj.weight
            assert torch.equal(torch.cat([gate_up[:96], gate_up[128:224]]), part)
            assert torch.equal(mlp.down_proj.dequantized_weight()[:, :96], reference_layer.mlp.down_proj.weight)
