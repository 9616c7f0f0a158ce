"""`TextStream.abort()` before the stream's first `next()` (the server stops a choice whose stream
was being made when its client went away): the request never runs and frees what it held."""

from __future__ import annotations

from mmpipe import SamplingParams


def test_abort_before_the_first_next_yields_nothing_and_frees_the_pages(pipe):
    stream = pipe.stream([{"role": "user", "content": "Hello"}],
                         SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
    stream.abort()
    assert list(stream) == []
    assert stream.finish_reason == "abort" and stream.num_generated_tokens == 0
    stats = pipe.stats()
    assert stats["kv_pages"]["free"] == stats["kv_pages"]["total"] and stats["requests"]["running"] == 0
