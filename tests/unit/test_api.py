"""The public Pipeline API: shapes of inputs and outputs, sampling controls, and errors."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from mmpipe import InputError, Pipeline, RequestMetrics, SamplingParams
from tests.helpers import random_image


def image_chat(seed: int, text: str = "Describe this image.", size=(120, 90)):
    return [{"role": "user", "content": [{"type": "image", "image": random_image(*size, seed=seed)},
                                         {"type": "text", "text": text}]}]


GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def test_single_conversation_or_list(pipe):
    one = pipe.chat(image_chat(1), GREEDY)
    many = pipe.chat([image_chat(1), image_chat(2)], GREEDY)
    assert len(one) == 1 and len(many) == 2
    assert one[0].token_ids == many[0].token_ids
    assert [o.index for o in many] == [0, 1]
    out = many[1]
    assert out.finish_reason == "length" and len(out.token_ids) == 12 and out.ok
    assert out.text == pipe.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.metrics.total_s >= out.metrics.time_to_first_token_s > 0


def test_generate_with_a_formatted_prompt_equals_chat(pipe):
    conv = image_chat(3)
    prompt, images = pipe.processor.render_chat(conv, "x")
    assert pipe.generate(prompt, [images], GREEDY)[0].token_ids == pipe.chat(conv, GREEDY)[0].token_ids
    bad = pipe.generate(prompt, [images * 2], GREEDY)[0]
    assert bad.finish_reason == "error" and "1 image placeholder(s) (<|image_pad|>) but 2 image(s)" in bad.error
    with pytest.raises(InputError, match="1 image placeholder.*2 image"):
        pipe.generate(prompt, [images * 2], GREEDY, errors="raise")


def test_assembling_token_ids_checks_the_image_count(pipe):
    """A caller that builds `Prepared` token ids itself (the benchmarks do) gets the same clear
    error as a prompt, not an index error from deep inside."""
    from mmpipe.engine.processor import Prepared

    sampling = GREEDY.resolve(pipe.defaults)
    image_id = pipe.processor.image_token_id
    with pytest.raises(InputError, match="ids: the prompt has 1 image placeholder.*0 image"):
        pipe.processor.assemble(Prepared(0, "ids", [5, image_id, 6], [], sampling, False), [])
    request = pipe.processor.assemble(Prepared(0, "ids", (5, 6, 7), [], sampling, False), [])
    assert request.prompt_ids == [5, 6, 7] and request.positions.tolist() == [[0, 1, 2]] * 3


def test_a_repeated_prompt_is_tokenised_once(pipe):
    """A captioning job sends one prompt per image: the tokenizer (which releases the GIL, and on a
    busy host then waits to get it back) runs once for it; each request still gets its own list."""
    from mmpipe.engine.processor import PROMPT_CHARS_KEPT, InputProcessor

    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, text, **kwargs):
            calls.append(text)
            return self.inner(text, **kwargs)

    processor = InputProcessor(Counting(pipe.tokenizer), pipe.processor.model, pipe.defaults, 4096)
    first = processor.prepare(0, "a photo of a fox", [], GREEDY, "p")
    first.token_ids.append(99)  # a caller extending its list
    second = processor.prepare(1, "a photo of a fox", [], GREEDY, "p")
    other = processor.prepare(2, "two foxes", [], GREEDY, "p")
    assert calls == ["a photo of a fox", "two foxes"]
    assert second.token_ids == pipe.tokenizer("a photo of a fox", add_special_tokens=False)["input_ids"]
    assert other.token_ids == pipe.tokenizer("two foxes", add_special_tokens=False)["input_ids"]
    long = "fox " * (PROMPT_CHARS_KEPT // 4 + 1)  # not kept: tokenised each time
    processor.prepare(3, long, [], GREEDY, "p")
    processor.prepare(4, long, [], GREEDY, "p")
    assert calls.count(long) == 2


def test_caption(pipe):
    captions = pipe.caption([random_image(64, 64, seed=1), random_image(90, 40, seed=2)],
                            sampling=SamplingParams(max_new_tokens=5))
    assert len(captions) == 2 and all(isinstance(c, str) for c in captions)


def test_stop_string_cuts_the_text(pipe):
    full = pipe.chat(image_chat(4), GREEDY)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = pipe.chat(image_chat(4), SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert full.token_ids[:len(out.token_ids)] == out.token_ids


def test_stop_strings_wait_for_min_new_tokens(pipe):
    full = pipe.chat(image_chat(4), GREEDY)[0]
    stop = full.text[3:6]
    cut = pipe.chat(image_chat(4), SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop]))[0]
    held = pipe.chat(image_chat(4), SamplingParams(max_new_tokens=12, min_new_tokens=12, ignore_eos=True,
                                                   stop=[stop]))[0]
    assert len(cut.token_ids) < 12 and held.token_ids == full.token_ids


def test_stop_token_ids_and_min_new_tokens(pipe):
    full = pipe.chat(image_chat(5), GREEDY)[0]
    target = full.token_ids[4]
    first = full.token_ids.index(target)
    out = pipe.chat(image_chat(5), SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]
    # Until min_new_tokens the stop token may not be sampled at all.
    first_token = full.token_ids[0]
    out = pipe.chat(image_chat(5), SamplingParams(max_new_tokens=6, min_new_tokens=4, ignore_eos=True,
                                                  stop_token_ids=[first_token]))[0]
    assert len(out.token_ids) >= 4 and first_token not in out.token_ids[:4]


def test_logprobs_are_reported_per_token(pipe):
    out = pipe.chat(image_chat(6), SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for token, entries in zip(out.token_ids, out.logprobs):
        assert token in entries and len(entries) >= 3
        assert max(entries.values()) == entries[token]  # greedy picks the most likely
    assert pipe.chat(image_chat(6), GREEDY)[0].logprobs is None


def test_seeded_sampling_is_reproducible_across_batches(pipe):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = pipe.chat(image_chat(7), params)[0].token_ids
    mixed = pipe.chat([image_chat(8), image_chat(7), image_chat(9)],
                      [SamplingParams(max_new_tokens=3, temperature=0.5), params, GREEDY])
    assert mixed[1].token_ids == alone
    other = pipe.chat(image_chat(7), SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=43,
                                                    ignore_eos=True))[0].token_ids
    assert other != alone


def test_bad_image_in_a_batch(pipe, caplog):
    batch = [image_chat(1), [{"role": "user", "content": [{"type": "image", "image": b"garbage"}]}], image_chat(2)]
    with pytest.raises(InputError, match="conversation 1, image 0: image bytes"):
        pipe.chat(batch, GREEDY, errors="raise")
    caplog.set_level(logging.DEBUG, logger="mmpipe")
    outs = pipe.chat(batch, GREEDY)
    # The caller gets the error in its output; the log repeats it only at debug level (no stderr line).
    failures = [r for r in caplog.records if "request 1 failed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.DEBUG]
    assert [o.ok for o in outs] == [True, False, True]
    assert outs[1].finish_reason == "error" and "not a recognised image" in outs[1].error
    assert outs[0].token_ids == pipe.chat(image_chat(1), GREEDY)[0].token_ids
    assert pipe.caption([b"garbage", random_image(30, 30)])[0] is None


def test_defaults_come_from_generation_config(checkpoint_factory):
    path = checkpoint_factory(generation={"do_sample": True, "temperature": 0.7, "top_k": 5, "max_new_tokens": 7})
    pipe = Pipeline.from_pretrained(path, device="cpu")
    assert (pipe.defaults.temperature, pipe.defaults.top_k, pipe.defaults.max_new_tokens) == (0.7, 5, 7)
    out = pipe.chat(image_chat(1), SamplingParams(ignore_eos=True, seed=1))[0]
    assert len(out.token_ids) == 7
    eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in pipe.defaults.eos_token_ids


def test_max_model_len(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", max_model_len=64)
    long_chat = image_chat(1, size=(400, 400))
    with pytest.raises(InputError, match="conversation 0: the prompt has \\d+ tokens; the limit .* is 64"):
        pipe.chat(long_chat, GREEDY, errors="raise")
    short = [{"role": "user", "content": "hi"}]
    outs = pipe.chat([long_chat, short], SamplingParams(max_new_tokens=500, ignore_eos=True))
    assert outs[0].finish_reason == "error" and outs[1].finish_reason == "length"
    assert "the prompt has" in outs[0].error
    assert outs[1].num_prompt_tokens + len(outs[1].token_ids) == 64


def test_tiny_kv_pool_and_small_groups_give_identical_results(pipe, checkpoint):
    """Static batching in many small groups (few pages, few slots) changes nothing."""
    batch = [image_chat(i, size=(80 + 20 * i, 100)) for i in range(6)]
    reference = [o.token_ids for o in pipe.chat(batch, GREEDY)]
    small = Pipeline.from_pretrained(checkpoint, device="cpu", num_kv_pages=14, kv_page_size=8,
                                     max_running_requests=2, max_prefill_tokens=40)
    assert [o.token_ids for o in small.chat(batch, GREEDY)] == reference
    assert small.runner.stats.prefill_forwards > len(batch)  # prompts really were chunked


def test_engine_options_are_validated(checkpoint):
    with pytest.raises(InputError, match="kv_page_size"):
        Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=0)
    with pytest.raises(InputError, match="no_such_option"):
        Pipeline.from_pretrained(checkpoint, device="cpu", no_such_option=1)
    with pytest.raises(InputError, match="dtype='int8'"):
        Pipeline.from_pretrained(checkpoint, device="cpu", dtype="int8")


def test_time_to_first_token_counts_from_the_call_including_slow_preprocessing(pipe, monkeypatch):
    """A delay injected into image preprocessing is in the request's time to first token (measured
    from the call) and in its preprocess share, for chat, chat_stream and stream."""
    delay = 0.3
    original = pipe.processor.load_image

    def slow(source, where):
        time.sleep(delay)
        return original(source, where)

    monkeypatch.setattr(pipe.processor, "load_image", slow)
    one = SamplingParams(max_new_tokens=2, ignore_eos=True)
    outputs = [pipe.chat(image_chat(5), one)[0], next(iter(pipe.chat_stream([image_chat(6)], one)))]
    with pipe.stream(image_chat(7), one) as stream:
        "".join(stream)
        outputs.append(stream)
    for out in outputs:
        m = out.metrics if isinstance(out.metrics, RequestMetrics) else out.metrics()
        assert m.preprocess_s >= delay
        assert m.time_to_first_token_s >= m.preprocess_s + m.queued_s
        assert m.total_s >= m.time_to_first_token_s
    # Without the delay the same request's preprocessing share is small: the delay is what was counted.
    monkeypatch.setattr(pipe.processor, "load_image", original)
    assert pipe.chat(image_chat(5), one)[0].metrics.preprocess_s < delay


def test_startup_report_times_each_phase(checkpoint, monkeypatch):
    """A delay injected into the tokenizer load shows up in that phase, not in another, and the
    report's line, stats and total agree."""
    import mmpipe.pipeline as pipeline_module

    original = pipeline_module.load_tokenizer

    def slow(path):
        time.sleep(0.25)
        return original(path)

    monkeypatch.setattr(pipeline_module, "load_tokenizer", slow)
    with Pipeline.from_pretrained(checkpoint, device="cpu") as pipe:
        phases = {p["name"]: p["seconds"] for p in pipe.stats()["startup"]["phases"]}
        assert list(phases) == ["weights", "tokenizer", "KV cache", "prefill graphs", "decode graphs"]
        assert phases["tokenizer"] >= 0.25 and phases["weights"] < 0.25
        total = pipe.stats()["startup"]["total_s"]
        assert abs(total - sum(phases.values())) < 1e-9
        line = pipe.startup_report()
        assert line.startswith(f"start-up {total:.1f} s: weights") and f"tokenizer {phases['tokenizer']:.1f} s" in line
        assert "prefill graphs" in line and "no graphs" in line  # the CPU runs eagerly


@pytest.mark.parametrize("budget, most", [(1, 2), (1 << 30, 6)])
def test_inputs_read_ahead_stay_within_their_byte_budget(checkpoint, budget, most):
    """With a budget below one image, no more images are read than the two workers load before
    the first is measured; with room for all, every image is read ahead while the first decodes
    (the bound is what holds them back)."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", input_bytes_ahead=budget, max_running_requests=1,
                                    preprocess_workers=2)
    lock, live, peak = threading.Lock(), [0], [0]
    load = pipe.processor.load_image

    def counted(source, where):
        out = load(source, where)
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        return out

    pipe.processor.load_image = counted
    for _ in pipe.chat_stream([image_chat(seed) for seed in range(6)], SamplingParams(max_new_tokens=12,
                                                                                    ignore_eos=True)):
        with lock:
            live[0] -= 1
    pipe.close()
    assert peak[0] <= most if budget == 1 else peak[0] == most


def test_stream_prompt_equals_generate_and_reports_its_tokens(pipe):
    """A pre-formatted prompt streamed: the same text and tokens as generate(), the tokens read
    as they come add up to the output's, with their logprobs."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt, images = pipe.processor.render_chat(image_chat(3), "test")
    sources = [item.source for item in images]
    reference = pipe.generate([prompt], [sources], params)[0]
    stream = pipe.stream_prompt(prompt, sources, params)
    text, ids, logprobs = "", [], []
    for delta in stream:
        text += delta
        got, lps = stream.tokens_since(len(ids))
        ids += got
        logprobs += lps
    got, lps = stream.tokens_since(len(ids))
    ids += got
    logprobs += lps
    assert text == reference.text and ids == reference.token_ids == stream.output().token_ids
    assert logprobs == reference.logprobs and len(logprobs) == 8
    assert stream.output().finish_reason == "length"
    with pytest.raises(InputError, match="prompt: must be a string"):
        pipe.stream_prompt(5)
