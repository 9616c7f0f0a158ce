"""Qwen3-VL-MoE's experts stored one tensor per expert and projection (the Qwen team's FP8
releases), on the CPU: unquantized, they load to the 3D layout's exact answers; as block-scaled
FP8 (dequantized at load here: no FP8 tensor cores) they equal their weights dequantized by hand,
and differ from the unquantized model; a missing expert is reported by the layer it leaves
incomplete. The FP8 experts' own arithmetic (`Fp8Experts`, tile quantization, the reference with
scales) is checked here too; their kernels run in `tests/gpu/test_gpu_moe_fp8.py`."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmpipe import Pipeline, SamplingParams
from mmpipe.errors import CheckpointError
from mmpipe.kernels import moe
from mmpipe.layers.fp8_experts import Fp8Experts, quantize_blocks, quantize_experts
from tests.helpers import first_logits, make_checkpoint, rel_err
from tests.moe_checkpoints import fp8_per_expert, per_expert
from tests.parity_cases import one_image, two_images

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Experts 96 wide in 64-column blocks: the last block of every expert is partial.
    return make_checkpoint(str(tmp_path_factory.mktemp("moe")), family="qwen3_vl_moe",
                           text={"moe_intermediate_size": 96})


def _answers(path: str, conversation) -> tuple[list, list]:
    pipe = Pipeline.from_pretrained(path, device="cpu", dtype="float32")
    try:
        out = pipe.chat(conversation, PARAMS)[0]
        return out.token_ids, out.logprobs
    finally:
        pipe.close()


def test_experts_stored_one_tensor_each_load_to_the_same_answers(checkpoint, tmp_path):
    apart = per_expert(checkpoint, str(tmp_path / "apart"))
    assert sum(".experts.0.gate_proj.weight" in n for n in load_file(os.path.join(apart, "model.safetensors"))) == 2
    assert _answers(apart, two_images()) == _answers(checkpoint, two_images())


def test_an_fp8_checkpoint_of_per_expert_tensors_equals_its_weights_dequantized_by_hand(checkpoint, tmp_path):
    quantized, reference = fp8_per_expert(checkpoint, tmp_path, block=(64, 64))
    ours = Pipeline.from_pretrained(quantized, device="cpu", dtype="float32")
    by_hand = Pipeline.from_pretrained(reference, device="cpu", dtype="float32")
    original = Pipeline.from_pretrained(checkpoint, device="cpu", dtype="float32")
    assert "dequantized to float32 at load (no FP8 tensor cores" in ours.model.quantization
    got, want = first_logits(ours, one_image()), first_logits(by_hand, one_image())
    assert rel_err(got, want) <= 1e-5
    assert rel_err(want, first_logits(original, one_image())) > 1e-3  # the FP8 rounding is really there
    assert [o.token_ids for o in ours.chat([one_image()], PARAMS)] == [o.token_ids for o in by_hand.chat([one_image()], PARAMS)]
    for pipe in (ours, by_hand, original):
        pipe.close()


def test_a_missing_expert_is_reported_by_the_layer_it_leaves_incomplete(checkpoint, tmp_path):
    apart = per_expert(checkpoint, str(tmp_path / "apart"))
    file = os.path.join(apart, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.language_model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\): language: layers\.2\.mlp\.experts\.gate_up_proj"):
        Pipeline.from_pretrained(apart, device="cpu")
    tensors["model.language_model.layers.2.mlp.experts.8.up_proj.weight"] = tensors[
        "model.language_model.layers.2.mlp.experts.4.up_proj.weight"].clone()  # a ninth of eight experts
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): .*layers\.2\.mlp\.experts\.8\.up_proj\.weight"):
        Pipeline.from_pretrained(apart, device="cpu")


def test_tile_quantization_scales_each_tile_by_its_own_range():
    torch.manual_seed(0)
    weight = torch.randn(3, 256, 384) * torch.rand(3, 256, 1) * torch.rand(1, 1, 384)
    values, scale = quantize_blocks(weight)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (3, 2, 3)
    tiles = values.float().reshape(3, 2, 128, 3, 128).abs().amax(dim=(2, 4))
    assert torch.equal(tiles, torch.full_like(tiles, 448.0))  # every tile's largest value at the FP8 maximum
    back = moe.dequantize_experts(values, scale, torch.float32)
    assert (back - weight).abs().max() <= weight.abs().amax() / 16  # E4M3 keeps 3 mantissa bits
    wrong = moe.dequantize_experts(values, scale.flip(1), torch.float32)
    assert (wrong - weight).abs().max() > 2 * (back - weight).abs().max()  # scales on the wrong tiles show


def test_fp8_experts_scale_each_tile_of_each_expert_by_its_own_scale():
    """Every expert's every 128 x 128 tile by its own scale (distinct scales for every tile of
    every expert, so a scale taken from another expert or tile shows), and the layer computed
    from those weights within FP8's rounding of the unquantized layer."""
    torch.manual_seed(1)
    experts, hidden, width, top_k = 3, 128, 256, 2
    gate_up, down = torch.randn(experts, 2 * width, hidden) * 0.05, torch.randn(experts, hidden, width) * 0.05
    fp8 = Fp8Experts.from_weights(gate_up, down)
    fp8.gate_up_scale.copy_(torch.arange(1.0, 1.0 + fp8.gate_up_scale.numel()).reshape(fp8.gate_up_scale.shape))
    plain_up, plain_down = fp8.dequantized()
    for e in range(experts):
        for i in range(2 * width // 128):
            tile = (slice(i * 128, (i + 1) * 128), slice(0, 128))
            assert torch.equal(plain_up[e][tile], fp8.gate_up_proj[e][tile].float() * fp8.gate_up_scale[e, i, 0])
    fp8 = Fp8Experts.from_weights(gate_up, down)
    x = torch.randn(9, hidden)
    weights, ids = moe.route(torch.randn(9, experts) * 3, top_k)
    ours = moe.experts(x, fp8.gate_up_proj, fp8.down_proj, weights, ids, scales=fp8.scales())
    assert 1e-4 < rel_err(ours, moe.experts_reference(x, gate_up, down, weights, ids)) < 0.1


def test_runtime_quantization_replaces_experts_of_whole_tiles_only(checkpoint):
    from mmpipe.language.qwen3_moe import Experts

    layer = torch.nn.Module()
    layer.experts = Experts(4, 128, 256)
    layer.experts.gate_up_proj.data.normal_()
    layer.experts.down_proj.data.normal_()
    narrow = torch.nn.Module()
    narrow.experts = Experts(4, 128, 96)
    holder = torch.nn.ModuleList([layer, narrow])
    assert quantize_experts(holder) == (1, 1)
    assert isinstance(layer.experts, Fp8Experts) and isinstance(narrow.experts, Experts)
    assert layer.experts.gate_up_scale.shape == (4, 4, 1) and layer.experts.down_scale.shape == (4, 1, 2)


def test_runtime_quantization_frees_each_layers_plain_experts_before_the_next(monkeypatch):
    """A model that fits only unquantized plus one layer's FP8 copy loads: when a layer is
    quantized, no earlier layer's plain experts are still held."""
    import weakref

    from mmpipe.language.qwen3_moe import Experts

    layers = torch.nn.ModuleList()
    for _ in range(3):
        layer = torch.nn.Module()
        layer.experts = Experts(2, 128, 128)
        layers.append(layer)
    plain = [weakref.ref(layer.experts.gate_up_proj) for layer in layers]
    alive_at_each_call = []
    original = Fp8Experts.from_weights.__func__

    def spy(cls, gate_up, down):
        alive_at_each_call.append(sum(ref() is not None for ref in plain))
        return original(cls, gate_up, down)

    monkeypatch.setattr(Fp8Experts, "from_weights", classmethod(spy))
    assert quantize_experts(layers) == (3, 0)
    assert alive_at_each_call == [3, 2, 1]  # this layer's and the ones not yet reached
    assert all(ref() is None for ref in plain)
