"""Encoding ahead (EngineConfig.encode_ahead): once a step is launched, the images of the requests
next in line are encoded into the encoder cache before the previous step's tokens are read. On
the CPU it runs in line when asked for (True), which is what these tests exercise; the device
side (the vision stream, the current stream waiting for it) is tests/gpu/test_gpu_encode_ahead.py."""

from __future__ import annotations

import pytest

from mmpipe import EngineConfig, Pipeline, SamplingParams
from mmpipe.errors import InputError
from tests.helpers import random_image

# Every image distinct: each is encoded exactly once, and no cache hit is an encoding saved.
IMAGES = [random_image(56 + 29 * (i % 6), 48 + 31 * (i % 5), seed=700 + i) for i in range(40)]
WORDS = "say what the picture shows in a few words".split()


def conversations(n: int) -> list:
    convs, k = [], 0
    for i in range(n):
        content = []
        for _ in range(1 + i % 2):
            content.append({"type": "image", "image": IMAGES[k]})
            k += 1
        content.append({"type": "text", "text": " ".join(WORDS[: 2 + i % 6])})
        convs.append([{"role": "user", "content": content}])
    return convs


PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.0, logprobs=2)


def make(checkpoint, ahead, **options):
    # A small vision budget spreads the images over several steps: there is always a next in line.
    return Pipeline.from_pretrained(checkpoint, device="cpu", overlap_schedule=True, encode_ahead=ahead,
                                    max_vision_patches=256, **options)


def test_results_are_those_without_it_and_each_image_is_encoded_once(checkpoint):
    convs = conversations(24)
    distinct = sum(1 + i % 2 for i in range(24))
    runs = {}
    for ahead in (False, True):
        with make(checkpoint, ahead) as pipe:
            assert pipe.engine.encode_ahead is ahead
            outputs = pipe.chat(convs, PARAMS, progress=False)
            runs[ahead] = outputs, pipe.runner.stats, pipe.engine.cache
    (off, off_stats, off_cache), (on, on_stats, on_cache) = runs[False], runs[True]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    for a, b in zip(on, off):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys() and all(abs(step_a[t] - step_b[t]) < 1e-5 for t in step_a)
    assert off_stats.images_encoded == on_stats.images_encoded == distinct
    assert off_stats.images_encoded_ahead == 0
    assert distinct // 2 < on_stats.images_encoded_ahead < distinct  # most ahead; the first step's in line
    assert on_cache.hits == off_cache.hits == 0  # taking an image encoded ahead is no hit


def _requests(pipe, convs):
    out = []
    for i, conv in enumerate(convs):
        prompt, images = pipe.processor.render_chat(conv, f"conversation {i}")
        prepared = pipe.processor.prepare(i, prompt, images, PARAMS, f"conversation {i}")
        loaded = [pipe.processor.load_image(src, "x") for src in prepared.image_sources]
        out.append(pipe.processor.assemble(prepared, loaded))
    return out


def test_it_takes_the_next_images_in_line_within_one_steps_vision_budget(checkpoint):
    with make(checkpoint, True) as pipe:
        requests = _requests(pipe, conversations(10))
        for request in requests:
            pipe.engine.add(request)
        images = [image for request in requests for image in request.images]
        budget = pipe.engine.cfg.max_vision_patches
        fits, used = 0, 0
        while fits < len(images) and used + images[fits].num_patches <= budget:
            used += images[fits].num_patches
            fits += 1
        assert 1 < fits < len(images)  # the budget cuts the line
        pipe.engine._encode_ahead()
        assert [image.key in pipe.engine.cache for image in images] == [True] * fits + [False] * (len(images) - fits)
        assert pipe.runner.stats.images_encoded_ahead == fits
        pipe.engine._encode_ahead()  # the next call goes on from where the line is uncached
        assert images[fits].key in pipe.engine.cache
        outputs = []
        while pipe.engine.scheduler.num_unfinished:
            outputs += pipe.engine.step()
        outputs += pipe.engine.drain()
        assert pipe.runner.stats.images_encoded == len(images)  # none encoded again by its step


def test_it_keeps_to_a_quarter_of_the_encoder_cache(checkpoint):
    with make(checkpoint, True) as pipe:
        requests = _requests(pipe, conversations(6))
        room = 2 * pipe.runner.embedding_bytes(requests[0].images[0]) + 1
        pipe.engine.cache.capacity = 4 * room  # the first image fits in a quarter; what follows does not
        for request in requests:
            pipe.engine.add(request)
        pipe.engine._encode_ahead()
        taken = [image.key in pipe.engine.cache for request in requests for image in request.images]
        assert taken[0] and not all(taken)
        assert pipe.engine.cache.used <= room


def test_an_image_that_fails_ahead_is_left_to_its_step(checkpoint):
    """Encoding ahead raising an input error changes nothing: the step that needs the images
    encodes them (and would report a bad one)."""
    convs = conversations(8)
    with make(checkpoint, False) as pipe:
        expected = [o.token_ids for o in pipe.chat(convs, PARAMS, progress=False)]
    with make(checkpoint, True) as pipe:
        calls = []

        def failing(images):
            calls.append(len(images))
            raise InputError("conversation 3, image 0: cannot be decoded")

        pipe.runner.encode_ahead = failing
        outputs = pipe.chat(convs, PARAMS, progress=False)
        assert calls and all(o.ok for o in outputs)
        assert [o.token_ids for o in outputs] == expected
        assert pipe.runner.stats.images_encoded == sum(1 + i % 2 for i in range(8))


def test_default_and_checks(checkpoint):
    """Off by default on the CPU (no vision stream), off without an encoder cache, and a value
    that is not a flag is refused by name."""
    with Pipeline.from_pretrained(checkpoint, device="cpu") as pipe:
        assert pipe.engine.encode_ahead is False
    with make(checkpoint, True, encoder_cache_bytes=0) as pipe:
        assert pipe.engine.encode_ahead is False
    with pytest.raises(InputError, match="encode_ahead"):
        EngineConfig(encode_ahead=1)  # type: ignore[arg-type]
