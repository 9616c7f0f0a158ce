"""Checkpoint loading: sharded files, both naming layouts, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmpipe import Pipeline
from mmpipe.errors import CheckpointError, UnsupportedModelError
from mmpipe.weights import split_name
from tests.helpers import make_checkpoint


def copy_of(src: str, dst) -> str:
    path = str(dst / "ckpt")
    shutil.copytree(src, path)
    return path


def edit_tensors(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def params(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {**{f"v.{k}": v for k, v in pipe.model.vision.state_dict().items()},
            **{f"l.{k}": v for k, v in pipe.model.language.state_dict().items()}}


def test_sharded_checkpoint_loads_the_same_weights(checkpoint, tmp_path):
    sharded = make_checkpoint(str(tmp_path / "sharded"), max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    a, b = params(Pipeline.from_pretrained(checkpoint, device="cpu")), params(Pipeline.from_pretrained(sharded,
                                                                                                       device="cpu"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_layouts_load_identically(checkpoint, checkpoint_factory):
    other = checkpoint_factory(layout="transformers")  # same seed and shapes as `checkpoint`
    names = load_file(os.path.join(other, "model.safetensors")).keys()
    assert any(n.startswith("model.language_model.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    a, b = params(Pipeline.from_pretrained(checkpoint, device="cpu")), params(Pipeline.from_pretrained(other,
                                                                                                       device="cpu"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_weights_load_in_the_requested_dtype(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", dtype="bfloat16")
    assert {p.dtype for p in pipe.model.language.parameters()} == {torch.bfloat16}
    assert pipe.model.language.rotary.inv_freq.dtype == torch.float32  # computed, not loaded


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\): language: layers.1.self_attn.k_proj.weight"):
        Pipeline.from_pretrained(path, device="cpu")


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    edit_tensors(path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2),
                                           "something_else": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"2 unexpected tensor\(s\): model.layers.0.mystery.weight, "
                                              r"something_else"):
        Pipeline.from_pretrained(path, device="cpu")


def test_shape_mismatch_is_named(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    edit_tensors(path, lambda t: t.update({"visual.blocks.0.attn.qkv.weight": torch.zeros(5, 5)}))
    with pytest.raises(CheckpointError, match=r"'blocks.0.attn.qkv.weight': shape \(5, 5\) does not match"):
        Pipeline.from_pretrained(path, device="cpu")


def test_unsupported_architecture(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    config_file = os.path.join(path, "config.json")
    config = json.load(open(config_file))
    config["architectures"] = ["LlavaForConditionalGeneration"]
    json.dump(config, open(config_file, "w"))
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration.*supported: Qwen2.5-VL .Qwen2_5_VL.*Qwen3-VL"):
        Pipeline.from_pretrained(path, device="cpu")


def test_missing_files_and_bad_paths(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        Pipeline.from_pretrained(str(tmp_path / "nowhere"), device="cpu")
    path = copy_of(checkpoint, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Pipeline.from_pretrained(path, device="cpu")


def test_name_layouts():
    assert split_name("model.visual.blocks.0.norm1.weight") == ("vision", "blocks.0.norm1.weight")
    assert split_name("visual.merger.mlp.0.bias") == ("vision", "merger.mlp.0.bias")
    assert split_name("model.language_model.layers.3.mlp.up_proj.weight") == ("language", "layers.3.mlp.up_proj.weight")
    assert split_name("model.norm.weight") == ("language", "norm.weight")
    assert split_name("lm_head.weight") == ("language", "lm_head.weight")
    assert split_name("vision_tower.x") is None


@pytest.mark.parametrize("bias,act", [(True, "silu"), (False, "silu"), (True, "gelu")])
def test_padded_mlp_width_computes_the_same(bias, act):
    """Widening the MLP to an aligned width (for cuBLAS's fast kernels) changes no result: the
    padded gate/up rows and down columns are zero, and the real blocks keep their places."""
    from mmpipe.layers.mlp import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(24, 37, act, bias=bias).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    x = torch.randn(5, 24)
    before = mlp(x)
    mlp.pad_width(16)
    assert mlp.hidden == 48 and mlp.gate_up_proj.weight.shape == (96, 24) and mlp.down_proj.weight.shape == (24, 48)
    assert not mlp.gate_up_proj.weight[37:48].any() and not mlp.gate_up_proj.weight[85:].any()
    assert not mlp.down_proj.weight[:, 37:].any() and mlp.down_proj.in_features == 48
    torch.testing.assert_close(mlp(x), before, rtol=1e-6, atol=1e-6)


def test_unaligned_mlp_widths_load_padded_and_match_transformers(checkpoint_factory):
    """Checkpoints whose MLP widths are not multiples of 64 (Qwen2.5-VL's vision tower: 3420)
    load padded, and the model still equals transformers."""
    from tests.helpers import hf_model
    from tests.parity_cases import assert_matches, two_images

    path = checkpoint_factory(vision={"intermediate_size": 100}, text={"intermediate_size": 90}, seed=7)
    pipe = Pipeline.from_pretrained(path, device="cpu")
    assert pipe.model.vision.blocks[0].mlp.hidden == 128
    assert pipe.model.language.layers[0].mlp.hidden == 128
    assert_matches(pipe, hf_model(path), path, two_images())
