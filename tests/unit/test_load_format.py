"""`load_format="dummy"`: random weights drawn on the device for a checkpoint of configs and
tokenizer alone (the benchmarks' shapes too large to write): it loads and generates, its norms
are ones and its routers spread rows over the experts; "auto" on the same directory still asks
for the weight files, and an unknown format is named."""

from __future__ import annotations

import os

import pytest
import torch
from mmpipe.app.tiny.synthetic import FAMILY_CONFIGS, write_checkpoint
from mmpipe.language.qwen3_moe import SparseMoE

from mmpipe import EngineConfig, Pipeline, SamplingParams
from mmpipe.errors import CheckpointError, InputError
from tests.helpers import make_tokenizer
from tests.parity_cases import one_image


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    tokenizer = make_tokenizer()
    path = str(tmp_path_factory.mktemp("dummy"))
    write_checkpoint(path, FAMILY_CONFIGS["qwen3_vl_moe"](tokenizer), tokenizer)
    assert not any(f.endswith(".safetensors") for f in os.listdir(path))
    return path


def test_a_config_only_checkpoint_loads_random_weights_and_generates(config_only):
    seen: list[torch.Tensor] = []
    original = SparseMoE.route

    def record(self, x):
        weights, ids = original(self, x)
        seen.append(ids)
        return weights, ids

    SparseMoE.route = record
    try:
        with Pipeline.from_pretrained(config_only, device="cpu", load_format="dummy") as pipe:
            out = pipe.chat(one_image(), SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0]
            language = pipe.model.language
            norm = language.layers[0].input_layernorm.weight
            weight = language.layers[0].self_attn.qkv_proj.weight
    finally:
        SparseMoE.route = original
    assert len(out.token_ids) == 4
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.015 < weight.std().item() < 0.025  # N(0, 0.02), not the storage's leftovers
    prompt_ids = torch.cat([ids for ids in seen if ids.shape[0] > 1])
    assert prompt_ids.unique().numel() == 8  # every expert of the tiny config is chosen somewhere


def test_auto_still_needs_the_weight_files_and_unknown_formats_are_named(config_only):
    with pytest.raises(CheckpointError):
        Pipeline.from_pretrained(config_only, device="cpu")
    with pytest.raises(InputError, match="load_format='safetensors'"):
        EngineConfig(load_format="safetensors")
