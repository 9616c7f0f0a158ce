"""The continuous-batching engine: batching never changes results, preemption loses nothing,
chunked prefill keeps decoding going, the encoder cache encodes an image once, streaming and
aborts free what they hold."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from mmpipe.vision.preprocess import ImageProcessorConfig, preprocess_image
from PIL import Image

from mmpipe import Pipeline, SamplingParams
from tests.helpers import random_image

IMAGES = [random_image(60 + 37 * (i % 7), 50 + 29 * (i % 5), seed=100 + i) for i in range(12)]
WORDS = "tell me about the picture in a few words please and be brief about it".split()


def mixed_requests(n: int):
    """Conversations with 0, 1 or 2 images and prompts of varied length, and varied max_new_tokens."""
    convs, params = [], []
    for i in range(n):
        text = " ".join(WORDS[: 1 + (i * 5) % len(WORDS)])
        content = [{"type": "image", "image": IMAGES[(i + k) % len(IMAGES)]} for k in range(i % 3)]
        content.append({"type": "text", "text": text})
        convs.append([{"role": "user", "content": content}])
        params.append(SamplingParams(max_new_tokens=3 + (i * 7) % 17, ignore_eos=True, temperature=0.0))
    return convs, params


@pytest.fixture(scope="module")
def alone(pipe):
    """Each of the 64 requests run by itself."""
    convs, params = mixed_requests(64)
    return [pipe.chat(c, p)[0].token_ids for c, p in zip(convs, params)]


def test_64_mixed_requests_equal_each_alone(pipe, alone):
    convs, params = mixed_requests(64)
    outputs = pipe.chat(convs, params)
    assert [o.index for o in outputs] == list(range(64))
    assert [o.token_ids for o in outputs] == alone
    assert all(len(o.token_ids) == p.max_new_tokens for o, p in zip(outputs, params))


def test_forced_preemption_gives_identical_results(checkpoint, alone):
    """A KV pool far too small for the batch: requests are preempted and recomputed."""
    small = Pipeline.from_pretrained(checkpoint, device="cpu", num_kv_pages=64, kv_page_size=4,
                                     max_prefill_tokens=96)
    convs, params = mixed_requests(64)
    outputs = small.chat(convs, params)
    assert small.engine.scheduler.preemptions > 0
    assert [o.token_ids for o in outputs] == alone
    assert small.runner.pages.num_free == small.runner.pages.capacity  # every page came back


def test_max_running_requests_is_respected(checkpoint, alone):
    capped = Pipeline.from_pretrained(checkpoint, device="cpu", max_running_requests=5)
    peak = []
    step = capped.engine.step

    def watched():
        peak.append(len(capped.engine.scheduler.running))
        return step()

    capped.engine.step = watched
    convs, params = mixed_requests(64)
    assert [o.token_ids for o in capped.chat(convs, params)] == alone
    assert max(peak) == 5


@pytest.mark.parametrize("overlap", [False, True])
def test_long_prompt_is_chunked_while_decoding_continues(checkpoint, overlap):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", max_prefill_tokens=32, overlap_schedule=overlap)
    short = pipe.processor.build(0, "hi", [], SamplingParams(max_new_tokens=40, ignore_eos=True), "short")
    engine = pipe.engine
    engine.add(short)
    while len(short.output_ids) < 2:  # decoding (with overlap, a token arrives a step after its step)
        engine.step()
    long_prompt = " ".join(WORDS * 12)
    long = pipe.processor.build(1, long_prompt, [], SamplingParams(max_new_tokens=2, ignore_eos=True), "long")
    assert long.prompt_len > 4 * 32
    engine.add(long)
    steps = 0
    while long.num_computed < long.prompt_len:
        before_short, before_long = len(short.output_ids), long.num_computed
        engine.step()
        steps += 1
        assert len(short.output_ids) == before_short + 1  # decoding advanced every step
        assert long.num_computed - before_long <= 32  # the prompt advanced one chunk
    assert steps >= 4
    while engine.scheduler.num_unfinished:
        engine.step()
    assert len(long.output_ids) == 2


def test_encoder_cache_encodes_a_repeated_image_once(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", prefix_caching=False)  # turn 2 looks its image up
    image = random_image(150, 120, seed=7)
    convs = [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": t}]}]
             for t in ("Describe this image.", "What colour?", "tell me about the picture")]
    fresh = [Pipeline.from_pretrained(checkpoint, device="cpu").chat(c, SamplingParams(max_new_tokens=6))[0]
             for c in convs]
    outputs = pipe.chat(convs, SamplingParams(max_new_tokens=6))
    assert pipe.runner.stats.images_encoded == 1
    assert [o.token_ids for o in outputs] == [f.token_ids for f in fresh]
    # A multi-turn chat that repeats the image is not encoded again either.
    turn2 = convs[0] + [{"role": "assistant", "content": outputs[0].text},
                        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "again"}]}]
    hits = pipe.engine.cache.hits
    pipe.chat(turn2, SamplingParams(max_new_tokens=3))
    assert pipe.runner.stats.images_encoded == 1 and pipe.engine.cache.hits == hits + 2


def test_encoder_cache_keys_two_shapes_of_the_same_pixels_apart(pipe):
    """A uniform 28x56 and a uniform 56x28 image of one colour have the same pixel bytes (and
    the same patches) and differ only in shape: they must get two cache keys and be encoded
    twice, or the second would be given the first one's embeddings (another patch grid)."""
    wide, tall = Image.new("RGB", (56, 28), (7, 99, 201)), Image.new("RGB", (28, 56), (7, 99, 201))
    assert np.asarray(wide).tobytes() == np.asarray(tall).tobytes()
    exact = ImageProcessorConfig(min_pixels=1)  # no resize: the encoder sees these very pixels
    a, b = preprocess_image(wide, exact), preprocess_image(tall, exact)
    assert torch.equal(a.pixel_values, b.pixel_values) and a.grid_thw != b.grid_thw
    assert a.key != b.key

    cache, encoded = pipe.engine.cache, pipe.runner.stats.images_encoded
    entries = len(cache)
    convs = [[{"role": "user", "content": [{"type": "image", "image": image},
                                           {"type": "text", "text": "colour?"}]}]
             for image in (wide, tall, wide, tall)]
    outputs = pipe.chat(convs, SamplingParams(max_new_tokens=2))
    assert all(o.ok for o in outputs)
    assert pipe.runner.stats.images_encoded - encoded == 2  # each shape once, not one for both
    assert len(cache) - entries == 2


def test_encoder_cache_is_bounded_in_bytes(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", encoder_cache_bytes=40_000)
    pipe.caption(IMAGES, sampling=SamplingParams(max_new_tokens=1))
    cache = pipe.engine.cache
    assert 0 < cache.used <= 40_000 and cache.evictions > 0


def test_vision_batches_respect_the_patch_budget(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", max_vision_patches=300)
    packs = []  # (patches, images) of every ViT call
    run = pipe.runner.run_vision
    pipe.runner.run_vision = lambda images: (packs.append((sum(im.num_patches for im in images), len(images))),
                                             run(images))[1]
    convs, params = mixed_requests(24)
    outputs = pipe.chat(convs, params)
    assert all(o.ok for o in outputs)
    assert len(packs) > 1 and any(count > 1 for _, count in packs)
    assert all(patches <= 300 or count == 1 for patches, count in packs)  # only a lone big image may exceed


def test_streaming_deltas_concatenate_to_the_full_text(pipe):
    conv = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "héllo"}]}]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    full = pipe.chat(conv, params)[0]
    deltas = list(pipe.stream(conv, params))
    assert len(deltas) > 3 and "".join(deltas) == full.text


def test_streaming_with_a_stop_string_never_emits_the_removed_text(pipe):
    conv = [{"role": "user", "content": "Tell me a story about a fox."}]
    full = pipe.chat(conv, SamplingParams(max_new_tokens=30, ignore_eos=True))[0].text
    stop = full[10:13]
    deltas = list(pipe.stream(conv, SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop])))
    assert "".join(deltas) == full[:full.index(stop)]


def test_closing_a_stream_aborts_and_frees_pages(pipe):
    free = pipe.runner.pages.num_free
    stream = pipe.stream([{"role": "user", "content": "Tell me a story about a fox."}],
                         SamplingParams(max_new_tokens=200, ignore_eos=True))
    next(stream)
    assert pipe.runner.pages.num_free < free
    stream.close()
    assert pipe.runner.pages.num_free == free and not pipe.engine.scheduler.num_unfinished


def test_abort_frees_pages(pipe):
    free = pipe.runner.pages.num_free
    request = pipe.processor.build(0, "hello there", [], SamplingParams(max_new_tokens=50, ignore_eos=True), "x")
    pipe.engine.add(request)
    pipe.engine.step()
    assert pipe.runner.pages.num_free < free
    pipe.engine.abort(request)
    assert request.finish_reason == "abort" and pipe.runner.pages.num_free == free


def test_threads_share_one_engine(pipe, alone):
    convs, params = mixed_requests(64)
    results: dict[int, list] = {}

    def worker(part: int) -> None:
        outs = pipe.chat(convs[part::4], params[part::4])
        results[part] = [o.token_ids for o in outs]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for part in range(4):
        assert results[part] == alone[part::4]


def test_metrics_and_progress_bar(pipe, capsys):
    convs, params = mixed_requests(8)
    outputs = pipe.chat(convs, params, progress=True)
    assert "8/8" in capsys.readouterr().err
    for out in outputs:
        m = out.metrics
        assert 0 <= m.queued_s <= m.time_to_first_token_s <= m.total_s
        assert m.decode_tokens_per_s > 0 or len(out.token_ids) == 1
    pipe.chat(convs, params)  # short calls show no bar by default
    assert "8/8" not in capsys.readouterr().err


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_leaves_the_engine_usable(checkpoint, alone, overlap):
    """A step that raises (say, out of memory) puts its requests back in line; the next steps
    finish every request with the same tokens. With overlap the failing step is launched while
    a decode step is in flight: its tokens are dropped and recomputed."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", overlap_schedule=overlap)
    convs, params = mixed_requests(8)
    requests = [pipe.processor.build(i, *pipe.processor.render_chat(c, "x"), p, "x")
                for i, (c, p) in enumerate(zip(convs, params))]
    for request in requests:
        pipe.engine.add(request)
    while not any(r.output_ids for r in requests):
        pipe.engine.step()
    pipe.engine.step()  # a decode step (with overlap: still in flight when the next one fails)
    assert any(r.pending for r in requests) == overlap
    lm = pipe.model.language
    lm.compute_logits = lambda *a: (_ for _ in ()).throw(RuntimeError("injected failure"))  # inside the decode step
    with pytest.raises(RuntimeError, match="injected"):
        pipe.engine.step()
    del lm.compute_logits
    while pipe.engine.scheduler.num_unfinished:
        pipe.engine.step()
    assert [r.output_ids for r in requests] == alone[:8]
    assert pipe.runner.pages.num_free == pipe.runner.pages.capacity


def test_the_same_lazily_opened_image_in_many_requests(pipe, tmp_path):
    """One PIL image object, opened lazily from a file, shared by requests decoded on several threads."""
    from PIL import Image

    path = tmp_path / "shared.png"
    random_image(150, 110, seed=3).save(path)
    image = Image.open(path)  # not loaded yet
    outputs = pipe.chat([[{"role": "user", "content": [{"type": "image", "image": image},
                                                       {"type": "text", "text": "Describe this image."}]}]] * 12,
                        SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert all(o.ok for o in outputs)
    assert len({tuple(o.token_ids) for o in outputs}) == 1


def test_the_engine_steps_before_the_whole_window_is_prepared(pipe, monkeypatch):
    """chat_stream prepares conversations a burst at a time: the first engine step comes after a
    few dozen are read, not after the whole look-ahead window (which kept the GPU idle at the
    start of a run), and every conversation is still answered once."""
    pulled = 0

    def conversations():
        nonlocal pulled
        for i in range(100):
            pulled += 1
            yield [{"role": "user", "content": f"tell me {i}"}]

    at_first_step: list[int] = []
    original = pipe.engine.step

    def step():
        if not at_first_step:
            at_first_step.append(pulled)
        return original()

    monkeypatch.setattr(pipe.engine, "step", step)
    outputs = list(pipe.chat_stream(conversations(), SamplingParams(max_new_tokens=2, ignore_eos=True)))
    assert sorted(o.index for o in outputs) == list(range(100)) and all(o.ok for o in outputs)
    assert at_first_step[0] <= 40
