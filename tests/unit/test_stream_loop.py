"""The stream loop (`mmpipe.stream_loop`): one thread steps the engine for every `TextStream`; readers
on many threads get their text a token a step and equal to `chat`'s; abort, a dropped stream, a
failing step and `close` end streams without hangs and free their pages."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from mmpipe import Pipeline, SamplingParams
from tests.engine_helpers import idle

CONVERSATIONS = [[{"role": "user", "content": f"tell me about the picture number {i} " * (1 + i % 3)}]
                 for i in range(8)]


@pytest.fixture(scope="module")
def bundled():
    with Pipeline.from_pretrained(device="cpu") as pipeline:
        yield pipeline


def _scene(i: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": f"assets/images/scene_{i % 6}.png"},
                                         {"type": "text", "text": "Describe this image."}]}]


def test_streams_on_many_threads_get_a_token_a_step_and_chats_text(bundled):
    """The bundled model's captions are plain words (every token brings text): every delivery but
    the last carries exactly one new token."""
    pipe = bundled
    conversations = [_scene(i) for i in range(8)]
    params = [SamplingParams(max_new_tokens=10 + 2 * i, temperature=0.0) for i in range(8)]
    expected = pipe.chat(conversations, params)
    deliveries: list[list[int]] = [[] for _ in range(8)]  # new tokens per delivery
    texts = [""] * 8
    done = [threading.Event() for _ in range(8)]
    streams = [pipe.stream(c, p) for c, p in zip(conversations, params)]

    def listener(i: int):
        seen = [0]

        def on(delta, finished):
            ids, _ = streams[i].tokens_since(seen[0])
            seen[0] += len(ids)
            deliveries[i].append(len(ids))
            texts[i] += delta
            if finished:
                done[i].set()
        return on

    for i, stream in enumerate(streams):
        stream.subscribe(listener(i))
    assert all(d.wait(60) for d in done)
    assert texts == [o.text for o in expected]
    for i, counts in enumerate(deliveries):
        assert sum(counts) == len(expected[i].token_ids)
        assert max(counts[:-1]) == 1  # a token a step: the loop never steps twice between deliveries
    # Readers iterating on their own threads get the same text.
    results = [None] * 8

    def read(i: int) -> None:
        with pipe.stream(conversations[i], params[i]) as stream:
            results[i] = "".join(stream)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [o.text for o in expected]
    assert idle(pipe)


def test_abort_from_another_thread_and_a_dropped_stream_free_their_pages(pipe):
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    stream = pipe.stream(CONVERSATIONS[0], long)
    first = next(stream)
    assert first
    threading.Timer(0.05, stream.abort).start()
    rest = list(stream)  # ends once the loop has aborted it
    assert stream.finish_reason == "abort" and len(first + "".join(rest)) < 4000
    assert idle(pipe)
    dropped = pipe.stream(CONVERSATIONS[1], SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True))
    next(dropped)
    request = dropped.request
    del dropped
    gc.collect()
    assert idle(pipe)
    assert request.finish_reason == "abort" and len(request.output_ids) < 4000  # its reader gone: aborted


def test_a_failing_step_reaches_every_reader_and_the_pipeline_goes_on(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    try:
        streams = [pipe.stream(c, SamplingParams(max_new_tokens=4000, ignore_eos=True)) for c in CONVERSATIONS[:3]]
        for stream in streams:
            next(stream)
        step = pipe.engine.step

        def broken():
            raise RuntimeError("the device fell over")

        pipe.engine.step = broken
        for stream in streams:
            with pytest.raises(RuntimeError, match="fell over"):
                list(stream)
        pipe.engine.step = step
        assert idle(pipe)
        assert pipe.chat(CONVERSATIONS[0], SamplingParams(max_new_tokens=4))[0].token_ids
        assert "".join(pipe.stream(CONVERSATIONS[0], SamplingParams(max_new_tokens=4)))
    finally:
        pipe.close()


def test_close_ends_running_streams_aborted_and_refuses_new_ones(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    stream = pipe.stream(CONVERSATIONS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True))
    next(stream)
    later = pipe.stream(CONVERSATIONS[1], SamplingParams(max_new_tokens=4))  # made, not started
    closer = threading.Thread(target=pipe.close)
    closer.start()
    list(stream)  # returns: the loop delivered the end
    closer.join(30)
    assert not closer.is_alive()
    assert stream.request.finish_reason == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        next(later)
    later.close()  # not started: returns at once


def test_a_reader_callback_that_raises_ends_its_stream_only(pipe):
    calls = []

    def broken(delta, done):
        calls.append(done)
        raise ValueError("the reader's bug")

    bad = pipe.stream(CONVERSATIONS[0], SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True))
    bad.subscribe(broken)
    deadline = time.monotonic() + 20
    while bad.request.finish_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bad.request.finish_reason == "abort" and len(bad.request.output_ids) < 300
    assert calls.count(True) <= 1  # never handed an end twice
    # The loop lives on: the next stream runs to its end (read on a thread, so a dead loop fails
    # the test instead of hanging it).
    text = []
    reader = threading.Thread(target=lambda: text.append("".join(
        pipe.stream(CONVERSATIONS[1], SamplingParams(max_new_tokens=6)))), daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive() and text[0]
    assert idle(pipe)


def test_a_subscribed_stream_nobody_keeps_still_reaches_its_listener(pipe):
    ended = threading.Event()
    texts = []

    def listener(delta, done):
        texts.append(delta)
        if done:
            ended.set()

    pipe.stream(CONVERSATIONS[2], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)).subscribe(listener)
    gc.collect()
    assert ended.wait(30)
    expected = pipe.chat(CONVERSATIONS[2], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert "".join(texts) == expected.text


def test_a_shared_after_step_hook_runs_once_a_step_after_that_steps_deliveries(pipe):
    """Four subscribed streams share one hook (a bound method, as the server's batcher): it runs
    once per step that delivered, after every listener call of that step."""
    log: list[str] = []
    done = threading.Event()

    class Batcher:
        def flush(self) -> None:
            log.append("flush")

    batcher, ended = Batcher(), [0]

    def on(delta, finished):
        log.append("text")
        if finished:
            ended[0] += 1
            if ended[0] == 4:
                done.set()

    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    streams = [pipe.stream(c, params) for c in CONVERSATIONS[:4]]
    for stream in streams:
        stream.subscribe(on, after_step=batcher.flush)
    assert done.wait(30)
    time.sleep(0.05)  # the last step's hook runs after its deliveries
    assert log[-1] == "flush" and log[0] == "text"
    steps = "".join("F" if e == "flush" else "t" for e in log).split("F")[:-1]
    assert all(steps) and all(len(s) <= 4 for s in steps)  # no step without deliveries, none counted twice
    assert sum(len(s) for s in steps) == log.count("text")
