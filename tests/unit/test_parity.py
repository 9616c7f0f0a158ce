"""mmpipe's own model code against transformers' Qwen2.5-VL on the same checkpoint (float32, CPU):
first-step logits within 1e-4 and 32 greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from tests.helpers import (
    hf_generate,
    hf_inputs,
    hf_model,
    max_logprob_diff,
    random_image,
    rel_err,
)
from tests.parity_cases import CASES, assert_matches, two_images  # noqa: F401

GREEDY_32 = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_model(checkpoint)


@pytest.mark.parametrize("case", list(CASES))
def test_single_prompt_matches_transformers(pipe, reference, checkpoint, case):
    assert_matches(pipe, reference, checkpoint, CASES[case]())


def test_batch_of_different_lengths_matches_each_alone(pipe, reference, checkpoint):
    """A batch through mmpipe equals transformers run on each prompt by itself."""
    conversations = [case() for case in CASES.values()]
    outputs = pipe.chat(conversations, GREEDY_32)
    lengths = {o.num_prompt_tokens for o in outputs}
    assert len(lengths) == len(conversations)  # really different lengths
    for conversation, out in zip(conversations, outputs):
        _, ref_tokens, ref_steps = hf_generate(reference, hf_inputs(checkpoint, conversation), 32)
        assert out.token_ids == ref_tokens
        assert max_logprob_diff(out.logprobs, ref_steps) <= 1e-4


@pytest.mark.parametrize("layout,tie", [("transformers", False), ("published", True), ("transformers", True)])
def test_layouts_and_tied_heads(checkpoint_factory, layout, tie):
    path = checkpoint_factory(layout=layout, tie=tie, seed=5)
    pipe = Pipeline.from_pretrained(path, device="cpu")
    assert (pipe.model.language.lm_head is None) == tie
    assert_matches(pipe, hf_model(path), path, two_images())


def test_window_attention_with_many_windows(checkpoint_factory):
    """A deeper ViT with two full-attention blocks and 28px windows: every image spans many windows."""
    path = checkpoint_factory(vision={"depth": 4, "fullatt_block_indexes": [1, 3], "window_size": 28}, seed=6)
    pipe = Pipeline.from_pretrained(path, device="cpu")
    conversation = two_images()
    request = pipe.processor.build(0, *pipe.processor.render_chat(conversation, "t"), SamplingParams(), "t")
    from mmpipe.vision.metadata import build_pack_meta

    cfg = pipe.model.vision.cfg
    meta = build_pack_meta([im.grid_thw for im in request.images], 2, cfg.window_size, cfg.patch_size)
    assert len(meta.window_lengths) > 4 * len(request.images)
    assert_matches(pipe, hf_model(path), path, conversation)


def test_vision_tower_matches_transformers(pipe, reference, checkpoint):
    """The ViT alone, on a pack of three images of different sizes."""
    from mmpipe.vision.metadata import build_pack_meta
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate([(200, 300), (56, 56), (420, 120)])]
    processed = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=images, return_tensors="pt")
    grids = [tuple(g.tolist()) for g in processed["image_grid_thw"]]
    with torch.no_grad():
        ref = reference.model.visual(processed["pixel_values"], grid_thw=processed["image_grid_thw"]).pooler_output
        cfg = pipe.model.vision.cfg
        ours = pipe.model.vision(processed["pixel_values"], build_pack_meta(grids, 2, cfg.window_size, cfg.patch_size))
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= 1e-5
