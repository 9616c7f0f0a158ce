"""Prefix caching on the GPU: in every graph mode, with the cache on, a multi-turn image
conversation, an identical request, a new question about the same image, a different image with
the same text and a prefix ending inside an image give the cache-off eager engine's float32 tokens
(log-probabilities to the graph tests' rounding); a pool small enough to evict and preempt
changes no greedy answer; and with FP8 weights the cache changes no bfloat16 greedy answer. Run
with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from mmpipe import GraphConfig, Pipeline, SamplingParams
from tests.gpu.test_gpu_decode_graphs import assert_same
from tests.helpers import random_image

pytestmark = pytest.mark.gpu

MODES = ["none", "piecewise", "full_decode_only", "full_and_piecewise"]
PAGE = 16
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0, logprobs=4)
IMAGES = [random_image(308, 224, seed=21), random_image(308, 224, seed=22)]  # one size: same tokens


def user(image, text: str) -> dict:
    return {"role": "user", "content": ([{"type": "image", "image": image}] if image is not None else [])
            + [{"type": "text", "text": text}]}


def make(checkpoint: str, mode: str, **options) -> Pipeline:
    return Pipeline.from_pretrained(checkpoint, device="cuda", dtype="float32", graph_mode=mode, kv_page_size=PAGE,
                                    max_running_requests=8, decode_graph=GraphConfig(buckets=(1, 2, 4, 8)), **options)


@pytest.fixture(scope="module")
def eager(checkpoint):
    pipe = make(checkpoint, "none", prefix_caching=False, overlap_schedule=False)
    yield pipe
    pipe.close()


@pytest.mark.parametrize("mode", MODES)
def test_every_graph_mode_with_the_cache_gives_eager_tokens_without_it(checkpoint, eager, mode):
    pipe = make(checkpoint, mode)
    try:
        conversation = [user(IMAGES[0], "Describe this image.")]
        for turn in range(3):  # each turn finds the earlier ones cached
            ours, reference = pipe.chat(conversation, GREEDY), eager.chat(conversation, GREEDY)
            assert_same(ours, reference)
            assert turn == 0 or ours[0].num_cached_tokens > ours[0].num_prompt_tokens // 2
            conversation = conversation + [{"role": "assistant", "content": ours[0].text}, user(None, "More?")]
        repeated = [user(IMAGES[0], "Describe this image.")]
        same_image = [user(IMAGES[0], "What colours are there?")]
        other_image = [user(IMAGES[1], "Describe this image.")]
        batch = [repeated, same_image, other_image]
        ours = pipe.chat(batch, GREEDY)
        assert_same(ours, eager.chat(batch, GREEDY))
        assert ours[0].num_cached_tokens == (ours[0].num_prompt_tokens - 1) // PAGE * PAGE
        request = pipe.processor.build(0, *pipe.processor.render_chat(other_image, "t"), GREEDY, "t")
        assert ours[2].num_cached_tokens <= request.image_starts[0]  # not the first image's pages
        assert pipe.stats()["prefix_cache"]["hits"] >= 4
    finally:
        pipe.close()


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_prefix_ending_inside_an_image_in_the_prefill_graphs(checkpoint, eager, mode):
    conversation = [user(IMAGES[1], "Describe this image.")]
    probe = eager.processor.build(0, *eager.processor.render_chat(conversation, "t"), GREEDY, "t")
    first, end = probe.image_starts[0], probe.image_starts[0] + probe.images[0].num_tokens
    cut = (first + end) // 2 // PAGE * PAGE + PAGE // 2
    pipe = make(checkpoint, mode, max_prefill_tokens=cut)
    try:
        request = pipe.processor.build(0, *pipe.processor.render_chat(conversation, "t"), GREEDY, "t")
        pipe.engine.add(request)
        pipe.engine.step()
        pipe.engine.drain()
        pipe.engine.abort(request)
        ours = pipe.chat(conversation, GREEDY)
        assert first < ours[0].num_cached_tokens < end
        assert_same(ours, eager.chat(conversation, GREEDY))
        assert pipe.stats()["prefill"]["graph_runs"] > 0
    finally:
        pipe.close()


def test_eviction_and_preemption_change_no_greedy_answer(checkpoint):
    kw = dict(device="cuda", dtype="float32", kv_page_size=PAGE, num_kv_pages=48, max_running_requests=8)
    pipe = Pipeline.from_pretrained(checkpoint, **kw)
    reference = Pipeline.from_pretrained(checkpoint, prefix_caching=False, **{**kw, "num_kv_pages": 4096})
    try:
        crowd = [[user(random_image(200 + 28 * (i % 3), 140, seed=60 + i), f"Picture {i}, in detail.")]
                 for i in range(8)] * 2  # the second half repeats the first: hits, where not evicted
        params = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.0)
        ours = pipe.chat(crowd, params)
        assert [o.token_ids for o in ours] == [o.token_ids for o in reference.chat(crowd, params)]
        stats = pipe.stats()
        assert stats["prefix_cache"]["evictions"] > 0 and stats["requests"]["preemptions"] > 0
    finally:
        pipe.close()
        reference.close()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores")
def test_fp8_weights_with_the_cache_give_the_greedy_answers_without_it(checkpoint):
    """At-load FP8 (every projection, activations quantized per row): turns 2 and 3 and a repeated
    request read their history's K/V from cached pages written by earlier forwards."""
    kw = dict(device="cuda", dtype="bfloat16", kv_page_size=PAGE, quantization="fp8-all", num_kv_pages=1024)
    pipe, reference = (Pipeline.from_pretrained(checkpoint, prefix_caching=on, **kw) for on in (True, False))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0)
    try:
        conversation = [user(IMAGES[0], "Describe this image.")]
        for turn in range(3):
            ours, expected = pipe.chat(conversation, params)[0], reference.chat(conversation, params)[0]
            assert ours.token_ids == expected.token_ids
            assert turn == 0 or ours.num_cached_tokens > 0
            conversation = conversation + [{"role": "assistant", "content": ours.text}, user(None, "More?")]
        again = pipe.chat(conversation, params)[0]
        assert again.num_cached_tokens > 0 and again.token_ids == reference.chat(conversation, params)[0].token_ids
    finally:
        pipe.close()
        reference.close()


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_short_turns_over_a_long_cached_context_replay_one_graph_as_decode_rows(checkpoint, eager, mode):
    """A turn of a few new tokens over a context long enough for the CUDA backend to run them as
    decode rows: the whole forward replays as one graph, and the answers are the cache-off eager
    engine's."""
    pipe = make(checkpoint, mode)
    try:
        conversation = [user(IMAGES[0], "Describe this image in every detail. " * 30)]
        for turn in range(3):
            runs = pipe.stats()["prefill"]["detail"]["row_graph_runs"]
            ours, reference = pipe.chat(conversation, GREEDY), eager.chat(conversation, GREEDY)
            assert_same(ours, reference)
            assert pipe.stats()["prefill"]["detail"]["row_graph_runs"] == runs + (turn > 0)
            assert turn == 0 or ours[0].num_prompt_tokens - ours[0].num_cached_tokens <= 64
            conversation = conversation + [{"role": "assistant", "content": ours[0].text}, user(None, "More?")]
        assert pipe.stats()["prefill"]["detail"]["row_graphs"] == 4  # sizes 8, 16, 32 and 64, at start-up
    finally:
        pipe.close()


def test_back_to_back_row_graph_steps_each_read_their_own_inputs(checkpoint):
    """Two short extends over a cached context replayed as row graphs while the GPU is still
    busy: the host writes the second step into the graphs' input region (pinned memory the
    GPU reads) only once the first replay has read it, so each gives what it gives alone."""
    import numpy as np

    from mmpipe.step_io import PrefillInputs

    pipe = make(checkpoint, "piecewise")
    try:
        prefiller, context = pipe.runner.prefiller, 600
        gen = torch.Generator(device="cuda").manual_seed(0)
        for k_cache, v_cache in prefiller.kv.layers:  # a cached context of random K/V in pages 1..
            for cache in (k_cache, v_cache):
                cache[1:50].normal_(generator=gen)
        pages = np.arange(1, 41, dtype=np.int32)

        def step(seed: int, n: int) -> PrefillInputs:
            rng = np.random.default_rng(seed)
            index = np.arange(context, context + n)
            return PrefillInputs(rng.integers(0, 500, n), rng.integers(0, 700, (3, n)),
                                 pages[index // PAGE].astype(np.int64) * PAGE + index % PAGE, [context + n], [n],
                                 pages[None, :], np.array([n - 1]), [])

        steps = [step(1, 5), step(2, 7)]
        alone = []
        for inputs in steps:
            hidden, _ = prefiller.run_inputs(inputs)
            alone.append(hidden[:inputs.token_ids.shape[0]].clone())
            torch.cuda.synchronize()
        runs = prefiller.rows.runs
        torch.cuda._sleep(200_000_000)  # every replay below is queued behind it
        busy = [prefiller.run_inputs(inputs)[0][:inputs.token_ids.shape[0]].clone() for inputs in steps]
        torch.cuda.synchronize()
        assert prefiller.rows.runs == runs + 2 and alone[0].abs().sum() > 0
        assert all(torch.equal(a, b) for a, b in zip(alone, busy))
        assert not torch.equal(alone[0][:5], alone[1][:5])
    finally:
        pipe.close()
