"""The vision encoder on its own CUDA stream (`EngineConfig.vision_stream`, on by default on
CUDA) gives exactly the results of running it in line, even when the two streams are pushed
apart on purpose: a vision stream held back by a sleep kernel before every ViT call (the step's
prefill must wait for the embeddings on the device), and a main stream held back before every
prefill while later steps encode on the vision stream (the embeddings a queued prefill still
reads must not be handed to the next ViT call's allocations). float32 runs the ViT eagerly,
bfloat16 through its CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from tests.helpers import random_image

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 20_000_000  # GPU clock cycles: far longer than a tiny model's step
IMAGES = [random_image(112, 112, seed=700 + i) for i in range(6)]  # one size: freed blocks fit the next call


def conversations() -> list:
    return [[{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": f"picture {i}, in a few words"}]}]
            for i, image in enumerate(IMAGES)]


def captions(pipe: Pipeline) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outputs = pipe.chat(conversations(), [params] * len(IMAGES), progress=False)
    assert pipe.runner.pages.num_free == pipe.runner.pages.capacity
    return [o.token_ids for o in outputs]


def make(checkpoint: str, dtype: str, on: bool, **options) -> Pipeline:
    # A patch budget of one image: each step encodes one image while the step before runs.
    pipe = Pipeline.from_pretrained(checkpoint, device="cuda", dtype=dtype, num_kv_pages=512, vision_stream=on,
                                    max_vision_patches=64, **options)
    assert (pipe.runner.vision_stream is not None) == on and pipe.stats()["vision_stream"] == on
    return pipe


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def reference(request, checkpoint):
    with make(checkpoint, request.param, False) as pipe:
        return request.param, captions(pipe)


def test_vision_stream_is_the_default_on_cuda(checkpoint):
    with Pipeline.from_pretrained(checkpoint, device="cuda", dtype="float32", num_kv_pages=64) as pipe:
        assert pipe.runner.vision_stream is not None


def test_prefill_waits_for_a_late_vision_stream(checkpoint, reference, monkeypatch):
    dtype, expected = reference
    with make(checkpoint, dtype, True) as pipe:
        runner, encode = pipe.runner, pipe.runner.run_vision
        calls = []

        def late(images):
            assert torch.cuda.current_stream() == runner.vision_stream  # the ViT's work is queued there
            torch.cuda._sleep(SLEEP_CYCLES)
            calls.append(len(images))
            return encode(images)

        monkeypatch.setattr(runner, "run_vision", late)
        assert captions(pipe) == expected
        assert calls == [1] * len(IMAGES)
        if dtype == "bfloat16":
            assert pipe.stats()["vit"]["replays"] > 0  # graphs replayed on the vision stream


def test_embeddings_outlive_a_late_prefill(checkpoint, reference, monkeypatch):
    dtype, expected = reference
    # No encoder cache: each image's embeddings are freed right after its prefill is queued.
    with make(checkpoint, dtype, True, encoder_cache_bytes=0) as pipe:
        runner, prefill = pipe.runner, pipe.runner.prefill
        late_prefills = []

        def late(chunks):
            assert torch.cuda.current_stream() != runner.vision_stream
            torch.cuda._sleep(SLEEP_CYCLES)
            late_prefills.append(len(chunks))
            return prefill(chunks)

        monkeypatch.setattr(runner, "prefill", late)
        assert captions(pipe) == expected
        assert len(late_prefills) >= len(IMAGES)
