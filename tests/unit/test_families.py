"""Qwen2-VL, Qwen3-VL and Qwen3-VL-MoE against transformers on tiny checkpoints built with its own classes
(float32, CPU): preprocessing, the vision tower (with Qwen3-VL's deepstack levels), first-step
logits and 32 greedy steps with their top-5 log-probabilities, for text, one image, two images of
different sizes, multi-turn and a batch of mixed lengths; both tensor-name layouts; deepstack rows
on the image tokens when a prompt's image is split across prefill chunks; the piecewise prefill
reading the deepstack buffers on every step (a text-only step first, an image step after)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmpipe.vision.metadata import build_pack_meta
from mmpipe.vision.preprocess import ImageProcessorConfig, preprocess_image

from mmpipe import Pipeline, SamplingParams
from mmpipe.config import GraphConfig
from tests.helpers import (
    hf_generate,
    hf_inputs,
    hf_model,
    make_checkpoint,
    max_logprob_diff,
    random_image,
    rel_err,
)
from tests.parity_cases import CASES, GREEDY_32, assert_matches, one_image, two_images
from tests.unit.test_prefill_graphs import simulated_piece_graphs  # noqa: F401  (a fixture)

FAMILIES = ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def make(family: str, **kwargs) -> str:
        key = (family, *sorted(kwargs.items()))
        if key not in cache:
            cache[key] = make_checkpoint(str(tmp_path_factory.mktemp(family)), family=family, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def family(request, family_checkpoints):
    """(path, our Pipeline, transformers' model) of one family's tiny checkpoint."""
    path = family_checkpoints(request.param)
    pipe = Pipeline.from_pretrained(path, device="cpu")
    yield path, pipe, hf_model(path)
    pipe.close()


def vision_pack(path: str, sizes):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    processed = Qwen2VLImageProcessorPil.from_pretrained(path)(images=images, return_tensors="pt")
    return images, processed


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_preprocessing_equals_transformers(family):
    path, pipe, _ = family
    images, processed = vision_pack(path, [(200, 300), (33, 47), (640, 90), (1000, 1000)])
    cfg = ImageProcessorConfig.from_dir(path)
    ours = [preprocess_image(image, cfg) for image in images]
    assert torch.equal(torch.cat([o.pixel_values for o in ours]), processed["pixel_values"])
    assert [o.grid_thw for o in ours] == [tuple(g.tolist()) for g in processed["image_grid_thw"]]
    patch = 16 if "qwen3" in path else 14
    assert cfg.patch_size == patch and all(o.grid_thw[1] * patch <= 2000 for o in ours)


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_vision_tower_matches_transformers(family):
    """A pack of three images of different sizes; for Qwen3-VL every deepstack level too."""
    path, pipe, reference = family
    _, processed = vision_pack(path, [(200, 300), (64, 64), (420, 120)])
    grids = [tuple(g.tolist()) for g in processed["image_grid_thw"]]
    cfg = pipe.model.vision.cfg
    with torch.no_grad():
        ref = reference.model.visual(processed["pixel_values"], grid_thw=processed["image_grid_thw"])
        ours = pipe.model.vision(processed["pixel_values"], build_pack_meta(grids, 2, cfg.window_size, cfg.patch_size))
    levels = getattr(ref, "deepstack_features", None) or []
    if levels:
        assert ours.shape == (ref.pooler_output.shape[0], 1 + len(levels), ref.pooler_output.shape[1])
        for level, features in enumerate(levels, start=1):
            assert rel_err(ours[:, level], features) <= 1e-4
        ours = ours[:, 0]
    else:
        assert "qwen2_vl" in path
    assert rel_err(ours, ref.pooler_output) <= 1e-4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_generation_matches_transformers(family, case):
    path, pipe, reference = family
    assert_matches(pipe, reference, path, CASES[case]())


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_batch_of_mixed_lengths_matches_each_alone(family):
    path, pipe, reference = family
    conversations = [case() for case in CASES.values()]
    outputs = pipe.chat(conversations, GREEDY_32)
    assert len({o.num_prompt_tokens for o in outputs}) == len(conversations)
    for conversation, out in zip(conversations, outputs):
        _, ref_tokens, ref_steps = hf_generate(reference, hf_inputs(path, conversation), 32)
        assert out.token_ids == ref_tokens
        assert max_logprob_diff(out.logprobs, ref_steps) <= 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_both_tensor_name_layouts_load(family_checkpoints, name):
    """`visual.*` / `model.*` and `model.visual.*` / `model.language_model.*` (with a tied head):
    the same weights give the same logits."""
    conversation = two_images()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    runs = []
    for layout in ("published", "transformers"):
        pipe = Pipeline.from_pretrained(family_checkpoints(name, layout=layout, tie=True, seed=3), device="cpu")
        assert pipe.model.language.lm_head is None
        runs.append(pipe.chat(conversation, params)[0])
        pipe.close()
    assert runs[0].token_ids == runs[1].token_ids and runs[0].logprobs == runs[1].logprobs


def test_deepstack_rows_land_on_the_image_tokens_across_prefill_chunks(family_checkpoints):
    """A prefill budget smaller than the image: its rows (and their deepstack features) arrive in
    several chunks, and each chunk's rows must take the features of exactly its image tokens."""
    path = family_checkpoints("qwen3_vl")
    pipe = Pipeline.from_pretrained(path, device="cpu", max_prefill_tokens=24)
    conversation = one_image()
    _, ref_tokens, ref_steps = hf_generate(hf_model(path), hf_inputs(path, conversation), 32)
    out = pipe.chat(conversation, GREEDY_32)[0]
    image_tokens = hf_inputs(path, conversation)["mm_token_type_ids"].sum().item()
    assert image_tokens > 2 * 24 and pipe.stats()["runner"]["prefill_forwards"] >= out.num_prompt_tokens // 24
    assert out.token_ids == ref_tokens
    assert max_logprob_diff(out.logprobs, ref_steps) <= 1e-4
    pipe.close()


def test_deepstack_buffers_are_zero_outside_image_rows(family_checkpoints):
    """After an image step, a text step reads zeros in every deepstack row (a stale feature added
    to a text token would change its logits): the text step's logits equal a fresh Pipeline's."""
    path = family_checkpoints("qwen3_vl")
    text = CASES["text"]()
    params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)
    fresh = Pipeline.from_pretrained(path, device="cpu")
    expected = fresh.chat(text, params)[0].logprobs
    fresh.close()
    pipe = Pipeline.from_pretrained(path, device="cpu")
    pipe.chat(one_image(), params)
    deepstack = pipe.runner.prefiller.deepstack
    assert all(level.abs().sum() > 0 for level in deepstack)  # the image step's rows are still there
    assert pipe.chat(text, params)[0].logprobs == expected
    assert all(level.abs().sum() == 0 for level in deepstack)
    pipe.close()


def test_mlp_products_left_as_partial_sums_change_no_deepstack_layer(family_checkpoints, monkeypatch):
    """On the GPU a product of a few rows may come as K-split partial sums (`gemv.linear_split`),
    and a short prefill's rows (a row graph's) take those kernels: a deepstack layer must add them
    up before its features, to the very logits of the plain products."""
    from mmpipe.kernels.partial_sums import PartialSums
    from mmpipe.layers.mlp import GatedMLP

    path = family_checkpoints("qwen3_vl")
    params = SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=5)
    pipe = Pipeline.from_pretrained(path, device="cpu", prefix_caching=False)  # both runs compute alike
    expected = pipe.chat(one_image(), params)[0]
    plain = GatedMLP.forward

    def split(self, x):  # two slices whose sum, rounded, is the plain product
        out = plain(self, x)
        return PartialSums(torch.stack([out.float(), torch.zeros_like(out, dtype=torch.float32)]), out.dtype)

    monkeypatch.setattr(GatedMLP, "forward", split)
    ours = pipe.chat(one_image(), params)[0]
    assert ours.token_ids == expected.token_ids and ours.logprobs == expected.logprobs
    pipe.close()


@pytest.mark.usefixtures("simulated_piece_graphs")
@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_vl_moe"])
def test_piecewise_prefill_reads_deepstack_after_a_text_only_capture(family_checkpoints, name):
    """Graphs captured on text-only start-up forwards, a text-only step replayed first, then image
    steps at sizes already replayed: tokens equal the eager pipeline's, every step on graphs."""
    path = family_checkpoints(name)
    kw = dict(device="cpu", max_prefill_tokens=64, max_running_requests=4)
    graphs = Pipeline.from_pretrained(path, prefill_graph=GraphConfig(buckets=(16, 32, 64)), **kw)
    eager = Pipeline.from_pretrained(path, prefill_graph=GraphConfig(enabled=False), graph_mode="none", **kw)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.0, logprobs=5)
    steps = [CASES["text"](), one_image(), [{"role": "user", "content": "count to five " * 3}], two_images()]
    for conversation in steps:
        ours, ref = graphs.chat(conversation, params)[0], eager.chat(conversation, params)[0]
        assert ours.token_ids == ref.token_ids
        assert max(abs(a[t] - b[t]) for a, b in zip(ours.logprobs, ref.logprobs) for t in b) <= 1e-5
    stats = graphs.stats()["prefill"]
    assert stats["graph_runs"] > 0 and stats["detail"]["compiled_runs"] == 0
    graphs.close()
    eager.close()


def test_interleaved_mrope_tables_equal_transformers():
    """The frequency-to-axis map of Qwen3's interleaved M-RoPE, on positions whose t, h and w differ."""
    from mmpipe.language.qwen2 import MRotary
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, head_dim=40,
                               rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                "mrope_section": [8, 6, 6], "mrope_interleaved": True})
    positions = torch.from_numpy(np.random.default_rng(0).integers(0, 5000, (3, 50)))
    ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[:, None])
    cos, sin = MRotary(40, 5e6, (8, 6, 6), interleaved=True)(positions, torch.float32)
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    chunked, _ = MRotary(40, 5e6, (8, 6, 6), interleaved=False)(positions, torch.float32)
    assert not torch.equal(chunked, cos)


def test_kv_sizing_reserves_the_deepstack_buffers(family_checkpoints):
    """The KV cache is sized before the prefill runner allocates its deepstack buffers: the reserve
    must hold them (levels x max_prefill_tokens x hidden)."""
    import dataclasses

    pipe = Pipeline.from_pretrained(family_checkpoints("qwen3_vl"), device="cpu", max_prefill_tokens=96)
    lm = pipe.model.language
    with_levels = pipe.runner._activation_reserve()
    lm.cfg = dataclasses.replace(lm.cfg, deepstack_levels=0)
    assert with_levels - pipe.runner._activation_reserve() == 2 * 96 * lm.hidden_size * 4  # 2 levels, float32
    assert sum(b.numel() * b.element_size() for b in pipe.runner.prefiller.deepstack) == 2 * 96 * lm.hidden_size * 4
    pipe.close()
