"""A request whose image cannot be encoded even alone (the device runs out of memory) fails alone,
with a clear error; the other requests of its step, and the engine, carry on (injected
allocation failures: the same exception types the CUDA allocator raises)."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from tests.helpers import random_image

GREEDY = SamplingParams(max_new_tokens=6)


def _chat(image) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
def test_an_image_too_big_even_alone_fails_its_request_only(error):
    small_a, big, small_b = random_image(64, 64, seed=1), random_image(256, 224, seed=2), random_image(72, 64, seed=3)
    with Pipeline.from_pretrained(device="cpu") as pipe:
        want = [o.token_ids for o in pipe.chat([_chat(small_a), _chat(small_b)], GREEDY)]
        limit = max(pipe.processor.load_image(im, "x").num_patches for im in (small_a, small_b))
        assert pipe.processor.load_image(big, "x").num_patches > limit
        run_vision = pipe.runner.run_vision
        packs = []

        def allocator(images):
            too_big = sum(im.num_patches for im in images) > limit  # the big image does not fit, even alone
            packs.append((len(images), too_big))
            if too_big:
                raise error("out of memory (injected)")
            return run_vision(images)

        pipe.runner.run_vision = allocator
        pipe.engine.cache.clear()
        outs = pipe.chat([_chat(small_a), _chat(big), _chat(small_b)], GREEDY)
        assert [o.ok for o in outs] == [True, False, True]
        assert "out of GPU memory encoding it, even alone" in outs[1].error and "image 0" in outs[1].error
        assert [outs[0].token_ids, outs[2].token_ids] == want  # the others, unchanged
        assert (1, True) in packs  # tried alone before its request failed
        for k, (count, failed) in enumerate(packs):  # a failed pack is retried one image at a time
            if failed and count > 1:
                assert [c for c, _ in packs[k + 1:k + 1 + count]] == [1] * count
        stats = pipe.stats()
        assert stats["requests"]["running"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]
        # The engine goes on: the same small image again, and the big one now fails the same way.
        again = pipe.chat([_chat(small_a), _chat(big)], GREEDY)
        assert again[0].token_ids == want[0] and not again[1].ok
