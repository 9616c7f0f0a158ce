"""Encoding ahead on CUDA (`EngineConfig.encode_ahead`, on by default with the vision stream and
overlapped scheduling): the ViT work for the requests next in line is queued on the vision stream
without the current stream waiting, and the step that prefills those images waits for it on the
device. A sleep kernel before every ViT call holds the vision stream back, so a prefill that read
embeddings encoded ahead before their ViT work ran would read unwritten memory: the captions must
equal those of a run without encoding ahead. float32 runs the ViT eagerly, bfloat16 through its
CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from tests.helpers import random_image

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 20_000_000  # about 10 ms: far longer than a tiny model's step
IMAGES = [random_image(112, 112, seed=900 + i) for i in range(10)]


def conversations() -> list:
    return [[{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": f"picture {i}, in a few words"}]}]
            for i, image in enumerate(IMAGES)]


def captions(pipe: Pipeline) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outputs = pipe.chat(conversations(), [params] * len(IMAGES), progress=False)
    assert pipe.runner.pages.num_free == pipe.runner.pages.capacity
    return [o.token_ids for o in outputs]


def make(checkpoint: str, dtype: str, ahead: bool | None, **options) -> Pipeline:
    # A patch budget of two images: the line ahead always has images to encode.
    return Pipeline.from_pretrained(checkpoint, device="cuda", dtype=dtype, num_kv_pages=512, encode_ahead=ahead,
                                    max_vision_patches=128, **options)


def test_on_by_default_with_the_vision_stream_and_overlap(checkpoint):
    with make(checkpoint, "float32", None) as pipe:
        assert pipe.engine.encode_ahead
    with make(checkpoint, "float32", None, overlap_schedule=False) as pipe:
        assert not pipe.engine.encode_ahead
    with make(checkpoint, "float32", None, vision_stream=False) as pipe:
        assert not pipe.engine.encode_ahead


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_waits_for_images_encoded_ahead_on_a_late_vision_stream(checkpoint, dtype, monkeypatch):
    with make(checkpoint, dtype, False) as pipe:
        expected = captions(pipe)
    with make(checkpoint, dtype, None) as pipe:
        runner, encode = pipe.runner, pipe.runner.run_vision
        calls = []

        def late(images):
            assert torch.cuda.current_stream() == runner.vision_stream
            torch.cuda._sleep(SLEEP_CYCLES)
            calls.append(len(images))
            return encode(images)

        monkeypatch.setattr(runner, "run_vision", late)
        assert captions(pipe) == expected
        assert sum(calls) == len(IMAGES)  # each image encoded once
        assert runner.stats.images_encoded_ahead >= len(IMAGES) // 2
        if dtype == "bfloat16":
            assert pipe.stats()["vit"]["replays"] > 0
