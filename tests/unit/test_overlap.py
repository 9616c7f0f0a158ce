"""Overlapped scheduling (plan and launch step N+1 before reading step N's tokens) gives exactly
the results of the plain order, and really overlaps; the scheduler keeps each step within its
prefill budget and preempts the newest request."""

from __future__ import annotations

import pytest

from mmpipe import EngineConfig, Pipeline, SamplingParams
from tests.overlap_cases import (  # noqa: F401 (collected here, with this module's pipes)
    WORDS,
    conversations,
    run_both,
    test_greedy_seeded_and_logprobs_are_identical,
    test_overlap_launches_the_next_step_before_reading_tokens,
    test_stops_end_at_the_same_token,
    test_streaming_deltas_and_abort,
)


@pytest.fixture(scope="module")
def pipes(checkpoint):
    """The same checkpoint with overlap off and on (small pages, so requests grow pages)."""
    made = {flag: Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=4, overlap_schedule=flag)
            for flag in (False, True)}
    assert not made[False].engine.overlap and made[True].engine.overlap
    yield made
    for pipe in made.values():
        pipe.close()


def test_a_preempting_pool_gives_identical_results(checkpoint):
    """Too few pages: requests are preempted, some while a token of theirs is in flight."""
    convs = conversations(16)
    params = SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.0)
    results = {}
    for flag in (False, True):
        pipe = Pipeline.from_pretrained(checkpoint, device="cpu", num_kv_pages=72, kv_page_size=4,
                                        max_prefill_tokens=96, overlap_schedule=flag)
        results[flag] = [o.token_ids for o in pipe.chat(convs, params, progress=False)]
        assert pipe.engine.scheduler.preemptions > 0
        assert pipe.runner.pages.num_free == pipe.runner.pages.capacity
    assert results[True] == results[False]


def test_overlap_default_follows_the_device(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    assert pipe.engine.overlap is False and pipe.stats()["overlap_schedule"] is False
    with pytest.raises(Exception, match="overlap_schedule"):
        EngineConfig(overlap_schedule="yes")  # type: ignore[arg-type]


def test_vision_stream_needs_cuda(checkpoint, caplog):
    """Asked for on the CPU, the vision stream is off and says so (nothing runs asynchronously
    there); a value that is not a flag is refused by name."""
    with caplog.at_level("INFO", logger="mmpipe"):
        pipe = Pipeline.from_pretrained(checkpoint, device="cpu", vision_stream=True)
    assert pipe.runner.vision_stream is None and pipe.stats()["vision_stream"] is False
    assert any("vision_stream needs CUDA" in r.getMessage() for r in caplog.records)
    pipe.close()
    for name in ("vision_stream", "overlap_schedule"):
        with pytest.raises(Exception, match=name):
            EngineConfig(**{name: 1})  # a flag, not a number that equals True


# ---------------------------------------------------------------------------- scheduler budgets

def test_prefill_tokens_of_one_step_never_exceed_the_budget(checkpoint):
    """Long prompts from many requests arrive together: every step's prefill chunks, summed over
    its requests, stay within max_prefill_tokens, and steps do pack several requests."""
    budget = 96
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", max_prefill_tokens=budget)
    per_step: list[list[int]] = []
    prefill = pipe.runner.prefill

    def spy(chunks):
        per_step.append([c.end - c.start for c in chunks])
        return prefill(chunks)

    pipe.runner.prefill = spy
    convs = [[{"role": "user", "content": " ".join(WORDS * (1 + i % 4))}] for i in range(12)]
    pipe.chat(convs, SamplingParams(max_new_tokens=3, ignore_eos=True), progress=False)
    assert max(sum(chunks) for chunks in per_step) <= budget
    assert any(len(chunks) > 1 for chunks in per_step)  # several requests share a step's budget
    assert any(sum(chunks) == budget for chunks in per_step)  # and the budget is used in full


def test_the_newest_running_request_is_preempted(checkpoint):
    """When decoding runs out of pages, the request admitted last is the one sent back (it has
    the least work to redo), never an older one."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", num_kv_pages=40, kv_page_size=4, max_prefill_tokens=64)
    scheduler = pipe.engine.scheduler
    admitted: list[object] = []
    admit, preempt = scheduler._admit, scheduler._preempt
    victims: list[tuple[object, object]] = []

    def spy_admit(request):
        ok = admit(request)
        if ok:
            admitted.append(request)
        return ok

    def spy_preempt(request, plan):
        last_admitted = {id(r): i for i, r in enumerate(admitted)}  # as of now: readmissions count
        newest = max(scheduler.running, key=lambda r: last_admitted[id(r)])
        victims.append((request, newest))
        return preempt(request, plan)

    scheduler._admit, scheduler._preempt = spy_admit, spy_preempt
    convs = [[{"role": "user", "content": " ".join(WORDS[: 3 + i])}] for i in range(6)]
    outputs = pipe.chat(convs, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0), progress=False)
    assert len(victims) >= 2, "the pool was meant to run out"
    assert all(victim is newest for victim, newest in victims)
    assert all(len(o.token_ids) == 24 for o in outputs)


def test_a_request_with_a_token_in_flight_is_not_readmitted(checkpoint):
    """A request preempted while its token was in flight waits for it: recomputing without it
    would sample that token again."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", overlap_schedule=True)
    request = pipe.processor.build(0, *pipe.processor.render_chat([{"role": "user", "content": "hi"}], "t"),
                                   SamplingParams(max_new_tokens=8, ignore_eos=True), "t")
    request.output_ids, request.pending = [5], 1  # as _preempt leaves it, its second token in flight
    scheduler = pipe.engine.scheduler
    scheduler.waiting.append(request)
    assert scheduler.schedule().empty and scheduler.waiting[0] is request
    request.output_ids.append(7)
    request.pending = 0
    plan = scheduler.schedule()
    assert [(c.request, c.start, c.end) for c in plan.prefill] == [(request, 0, request.total_len)]
