"""Equivalence cases of overlapped scheduling, shared by test_overlap.py (CPU) and
test_gpu_overlap.py (CUDA, where step N+1's graphs really launch while step N runs). Each module
that imports the `test_*` functions collects them with its own `pipes` fixture: {False: a pipeline
with overlap off, True: on}."""

from __future__ import annotations

from mmpipe.language.host_tokens import HostTokens

from mmpipe import SamplingParams
from mmpipe.step_io import PendingDecode
from tests.helpers import random_image

IMAGES = [random_image(60 + 41 * (i % 5), 50 + 23 * (i % 4), seed=300 + i) for i in range(6)]


WORDS = "tell me about the picture in a few words please and be brief about it".split()


def conversations(n: int) -> list:
    convs = []
    for i in range(n):
        content = [{"type": "image", "image": IMAGES[(i + k) % len(IMAGES)]} for k in range(i % 3)]
        content.append({"type": "text", "text": " ".join(WORDS[: 1 + (i * 5) % len(WORDS)])})
        convs.append([{"role": "user", "content": content}])
    return convs


def run_both(pipes, convs, params):
    outputs = {flag: pipe.chat(convs, params, progress=False) for flag, pipe in pipes.items()}
    for pipe in pipes.values():
        assert pipe.runner.pages.num_free == pipe.runner.pages.capacity  # every page came back
        assert not pipe.runner.decoder.row_of
    return outputs[False], outputs[True]


def test_greedy_seeded_and_logprobs_are_identical(pipes):
    convs = conversations(24)
    params = [SamplingParams(max_new_tokens=2 + (i * 7) % 13, ignore_eos=True, temperature=0.0 if i % 2 else 1.3,
                             top_p=0.9 if i % 4 == 0 else 1.0, repetition_penalty=1.2 if i % 3 == 0 else None,
                             seed=1000 + i, logprobs=3 if i % 5 == 0 else None) for i in range(24)]
    off, on = run_both(pipes, convs, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    # Steps group requests differently (a first token joins the decode batch a step later), so
    # matrix products see other batch shapes: the same tokens, log-probabilities to rounding.
    for a, b in zip(on, off):
        assert (a.logprobs is None) == (b.logprobs is None)
        for step_a, step_b in zip(a.logprobs or [], b.logprobs or []):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a)
    assert [len(o.token_ids) for o in on] == [p.max_new_tokens for p in params]
    sampled = {tuple(o.token_ids) for o, p in zip(on, params) if p.temperature}
    assert len(sampled) > 1  # the seeded rows really sampled


def test_stops_end_at_the_same_token(pipes):
    """A stop token, a stop string and max_new_tokens end each request at the same token with
    overlap as without, though with overlap a request that stops already has a row in the step
    launched after its last one: that row's token is dropped, even once that step is read."""
    convs = conversations(6)
    probe = pipes[False].chat(convs, SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0),
                              progress=False)
    params = []
    for i, output in enumerate(probe):
        ids = output.token_ids
        if i % 3 == 0:
            params.append(SamplingParams(max_new_tokens=12, stop_token_ids=[ids[4]], temperature=0.0, ignore_eos=True))
        elif i % 3 == 1:
            text = pipes[False].tokenizer.decode(ids[:6])
            params.append(SamplingParams(max_new_tokens=12, stop=[text[-3:]], temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_new_tokens=3 + i, temperature=0.0, ignore_eos=True))
    ends, rows = {}, {}
    for flag, pipe in pipes.items():
        pipe.engine.drain()
        requests = [pipe.processor.build(i, *pipe.processor.render_chat(c, "t"), p, "t")
                    for i, (c, p) in enumerate(zip(convs, params))]
        for request in requests:
            pipe.engine.add(request)
        decoded = pipe.runner.stats.decode_tokens
        while pipe.engine.scheduler.num_unfinished:
            pipe.engine.step()
        pipe.engine.drain()  # the step launched after the last stop: its rows must change nothing
        ends[flag] = [(r.output_ids, r.to_output().text, r.finish_reason) for r in requests]
        rows[flag] = pipe.runner.stats.decode_tokens - decoded
        assert all(r.pending == 0 for r in requests)
    assert ends[True] == ends[False]
    assert [reason for _, _, reason in ends[True][:2]] == ["stop", "stop"]
    assert len(ends[True][0][0]) <= 5 < len(probe[0].token_ids)
    assert rows[True] > rows[False]  # the situation under test: rows past a stop were launched


def test_streaming_deltas_and_abort(pipes):
    """Streamed deltas concatenate to the final text; closing a stream mid-answer frees every page."""
    conv = conversations(3)[2]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.0)
    texts = {}
    for flag, pipe in pipes.items():
        with pipe.stream(conv, params) as stream:
            texts[flag] = "".join(stream)
        assert texts[flag] == pipe.chat(conv, params, progress=False)[0].text
        stream = pipe.stream(conv, params)
        next(stream)
        next(stream)
        stream.close()
        assert stream.finish_reason == "abort"
        assert pipe.runner.pages.num_free == pipe.runner.pages.capacity
        assert not pipe.runner.decoder.row_of
    assert texts[True] == texts[False]


def test_overlap_launches_the_next_step_before_reading_tokens(pipes, monkeypatch):
    """The order of events on the host: with overlap, a step is launched before the tokens of
    the step before are read; without, every step's tokens are read before the next launch."""
    events: list[str] = []
    launch, get = PendingDecode.__init__, HostTokens.get

    def spy_launch(self, *args, **kwargs):
        events.append("launch")
        launch(self, *args, **kwargs)

    def spy_get(self):
        events.append("read")
        return get(self)

    monkeypatch.setattr(PendingDecode, "__init__", spy_launch)
    monkeypatch.setattr(HostTokens, "get", spy_get)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)
    orders = {}
    for flag, pipe in pipes.items():
        pipe.engine.drain()  # a step an earlier test left in flight (its request had stopped)
        events.clear()
        pipe.chat(conversations(1), params, progress=False)
        orders[flag] = list(events)
    assert orders[False] == ["launch", "read"] * 8
    on = orders[True]
    assert on.count("launch") == on.count("read") == 8
    # After the first token (the prefill's, read before the request joins the decode batch),
    # each decode step is launched while the one before is still unread.
    assert "launch,launch,read" in ",".join(on)
    unread = max_unread = 0
    for event in on:
        unread += 1 if event == "launch" else -1
        max_unread = max(max_unread, unread)
    assert max_unread == 2
