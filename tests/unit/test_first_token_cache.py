"""A prompt prefilled before gives its first token without a forward (`first_token_cache`): the
identical request samples it from the logits kept then, computes the tokens after its last full
page together with that token, and answers exactly as without the cache, greedy, sampled or
constrained by a JSON schema, with overlapped scheduling too, through aborts, failed steps and
preemption, on two tensor-parallel ranks; a prompt that differs anywhere, its last tokens
included, is not served the kept logits, nor is one after the cache is reset."""

from __future__ import annotations

import pytest

from mmpipe import Pipeline, SamplingParams
from tests.helpers import random_image
from tests.unit import test_prefix_cache
from tests.unit.test_prefix_cache import PAGE, _Stub, assert_same, user

IMAGE = random_image(200, 150, seed=11)
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0, logprobs=3)
pipes, on = test_prefix_cache.pipes, test_prefix_cache.on  # the cache-on and cache-off engines (fixtures)


def counters(pipe) -> tuple[int, int, int]:
    return (pipe.stats()["prefix_cache"]["first_tokens"], pipe.runner.stats.prefill_forwards,
            pipe.runner.stats.prefill_tokens)


@pytest.mark.parametrize("sampling", [
    GREEDY, SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, seed=7, logprobs=2),
    SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=1,
                   json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})],
    ids=["greedy", "sampled", "json"])
def test_an_identical_request_takes_its_first_token_from_the_kept_logits(pipes, on, sampling):
    off = pipes[1]
    conversation = [user(IMAGE, "What is in the picture?")]
    on.chat(conversation, sampling)
    before = counters(on)
    ours = on.chat(conversation, sampling)[0]
    after = counters(on)
    assert_same(ours, off.chat(conversation, sampling)[0])
    assert after[0] - before[0] == 1
    # the tokens after the last full page are prefilled once, with the first token, in one forward
    assert after[1] - before[1] == 1 and after[2] - before[2] == ours.num_prompt_tokens - ours.num_cached_tokens + 1
    if sampling.json_schema is not None:  # the first token obeyed the grammar too
        assert ours.text.startswith("{")


def test_a_one_token_answer_runs_no_forward(on):
    conversation = [user(IMAGE, "Name one colour.")]
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    first = on.chat(conversation, one)[0]
    before = counters(on)
    again = on.chat(conversation, one)[0]
    assert again.token_ids == first.token_ids and counters(on)[:2] == (before[0] + 1, before[1])


def token_prompt(pipe, ids: list[int]):
    from mmpipe.engine.processor import Prepared

    sampling = GREEDY.resolve(pipe.defaults)
    return pipe.processor.assemble(Prepared(0, "ids", list(ids), [], sampling, False), [])


def answer(pipe, ids: list[int]):
    request = token_prompt(pipe, ids)
    with pipe.engine.lock:
        pipe.engine.add(request)
        while not request.finished:
            pipe.engine.step()
    return request


def test_prompts_that_differ_only_after_their_last_full_page_do_not_share_kept_logits(pipes, on):
    """The same full pages, then one different last token: the second prompt computes its own."""
    base = list(range(300, 300 + 4 * PAGE))
    first, second = base + [17], base + [18]
    answer(on, first)
    before = counters(on)
    ours = answer(on, second)
    assert counters(on)[0] == before[0]
    assert ours.num_cached_tokens == len(base)
    reference = answer(pipes[1], second)
    assert ours.output_ids == reference.output_ids
    assert answer(on, second).output_ids == reference.output_ids and counters(on)[0] == before[0] + 1


def test_a_reset_cache_keeps_no_logits(on):
    conversation = [user(IMAGE, "What is in the picture?")]
    on.chat(conversation, GREEDY)
    assert len(on.engine.scheduler.first_tokens) == 1
    on.reset_prefix_cache()
    before = counters(on)
    on.chat(conversation, GREEDY)
    assert counters(on)[0] == before[0] and len(on.engine.scheduler.first_tokens) == 1


def test_the_prompt_key_covers_the_tokens_their_positions_and_images_after_the_last_full_page():
    from mmpipe.engine.prefix_keys import extend_keys, prompt_key

    def key(image: str = "A", salt: str | None = None, last: int | None = None, shift: int = 0) -> bytes:
        stub = _Stub(image, salt)
        stub.prompt_len = 12
        if last is not None:
            stub.ids[-1] = last
        stub.pos = stub.pos + (stub.pos >= 11) * shift
        return prompt_key(stub, 1, 4)  # one full page; tokens 4..11 after it, the image at 5-6

    same = key()
    assert key() == same
    assert key(image="B") != same and key(salt="s") != same and key(last=7) != same and key(shift=1) != same
    stub = _Stub("A")
    assert prompt_key(type("S", (_Stub,), {"prompt_len": 12})("A"), 1, 4) not in extend_keys(stub, 3, 4)


def test_only_a_prompts_own_last_position_is_kept(on):
    """A recomputed request (preempted after it generated) completes its prefill with logits for
    its next token, not its first: those are not kept under its prompt's key."""
    import torch

    scheduler = on.engine.scheduler
    recomputed, fresh = token_prompt(on, list(range(300, 310))), token_prompt(on, list(range(400, 410)))
    recomputed.output_ids.append(5)
    scheduler.keep_first_logits([recomputed, fresh], torch.randn(2, 16))
    assert len(scheduler.first_tokens) == 1


def test_a_prompt_that_fills_its_last_page_reserves_one_for_its_first_token(pipes, on):
    text = "Describe this image"
    while True:  # a prompt of whole pages: its first token's K/V need a page of their own
        conversation = [user(IMAGE, text)]
        if on.processor.build(0, *on.processor.render_chat(conversation, "t"), GREEDY, "t").prompt_len % PAGE == 0:
            break
        text += "!"
    on.chat(conversation, GREEDY)
    before = counters(on)
    assert_same(on.chat(conversation, GREEDY)[0], pipes[1].chat(conversation, GREEDY)[0])
    assert counters(on)[0] == before[0] + 1


def run_together(pipe, requests) -> None:
    with pipe.engine.lock:
        for request in requests:
            pipe.engine.add(request)
        while pipe.engine.scheduler.num_unfinished:
            pipe.engine.step()
        pipe.engine.drain()


def test_two_prompts_completed_together_each_keep_and_get_their_own_row(pipes, on):
    """Both prompts complete in one prefill, then both come back in one step: each request gets
    its own prompt's row (the greedy tokens agree here, so the log-probabilities tell)."""
    off = pipes[1]
    convs = [[user(IMAGE, "What is in the picture?")], [user("Tell me a story about a cat.")]]

    def requests():
        return [on.processor.build(i, *on.processor.render_chat(c, "t"), GREEDY, "t") for i, c in enumerate(convs)]

    forwards = on.runner.stats.prefill_forwards
    run_together(on, requests())
    assert on.runner.stats.prefill_forwards - forwards == 1
    before = counters(on)
    ours = requests()
    run_together(on, ours)
    assert counters(on)[0] == before[0] + 2
    for request, conversation in zip(ours, convs):
        assert_same(request.to_output(), off.chat(conversation, GREEDY)[0])


@pytest.fixture(scope="module")
def overlapped(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, overlap_schedule=True)
    yield pipe
    pipe.close()


def test_with_overlap_identical_requests_of_every_sampling_setting_answer_as_without_the_cache(pipes, overlapped):
    conversation = [user(IMAGE, "What is in the picture?")]
    params = [GREEDY, SamplingParams(max_new_tokens=1, temperature=0.0),
              SamplingParams(max_new_tokens=5, temperature=0.8, seed=3, logprobs=2),
              SamplingParams(max_new_tokens=8, temperature=0.0, min_new_tokens=4, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=8, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3)]
    overlapped.chat(conversation, GREEDY)
    before = counters(overlapped)
    ours = overlapped.chat([conversation] * len(params), params)
    assert counters(overlapped)[0] - before[0] == len(params)
    for output, sampling in zip(ours, params):
        assert_same(output, pipes[1].chat(conversation, sampling)[0])
    assert overlapped.runner.pages.num_free == overlapped.runner.pages.capacity


def test_a_first_token_in_flight_survives_an_abort_and_a_failed_step(pipes, overlapped):
    """Aborted while its first token is in flight: the token is dropped, its pages come back.
    A step that fails while one is in flight: it is recomputed, its answer unchanged, and the
    kept logits are forgotten with the cached pages."""
    engine, conversation = overlapped.engine, [user(IMAGE, "Abort me please.")]
    overlapped.chat(conversation, GREEDY)

    def build(conv):
        return overlapped.processor.build(0, *overlapped.processor.render_chat(conv, "t"), GREEDY, "t")

    aborted, retried, fresh = build(conversation), build(conversation), build([user("a new prompt, not seen")])
    with engine.lock:
        engine.add(aborted)
        engine.step()
        assert aborted in engine._in_flight.first
        engine.abort(aborted)
        engine.drain()
        assert aborted.output_ids == [] and aborted.finish_reason == "abort"
        engine.add(retried)
        engine.step()  # its first token in flight; the next step's prefill (the fresh prompt) fails
        engine.add(fresh)
        real = overlapped.runner.forward_prefill

        def broken(inputs):
            raise RuntimeError("device lost")

        overlapped.runner.forward_prefill = broken
        try:
            with pytest.raises(RuntimeError):
                engine.step()
        finally:
            overlapped.runner.forward_prefill = real
        assert len(engine.scheduler.first_tokens) == 0
    run_together(overlapped, [])
    assert retried.output_ids == pipes[1].chat(conversation, GREEDY)[0].token_ids
    assert overlapped.runner.pages.num_free == overlapped.runner.pages.capacity


@pytest.mark.parametrize("overlap", [False, True])
def test_a_small_pool_that_preempts_changes_no_answer(checkpoint, pipes, overlap):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, num_kv_pages=70,
                                    overlap_schedule=overlap, max_prefill_tokens=96)
    try:
        convs = [[user(IMAGE, f"Question {i % 3}?")] for i in range(12)]
        params = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0)
        pipe.chat(convs[:3], params)
        ours = pipe.chat(convs, params)
        stats = pipe.stats()
        assert stats["prefix_cache"]["first_tokens"] > 0 and stats["requests"]["preemptions"] > 0
        for output, conversation in zip(ours, convs):
            assert output.token_ids == pipes[1].chat(conversation, params)[0].token_ids
        assert pipe.runner.pages.num_free == pipe.runner.pages.capacity
    finally:
        pipe.close()


def test_two_tensor_parallel_ranks(checkpoint, pipes):
    """Rank 0 samples the first token; the other rank computes the rest of the prompt with it."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, tensor_parallel_size=2)
    try:
        conversation = [user(IMAGE, "What is in the picture?")]
        pipe.chat(conversation, GREEDY)
        for _ in range(2):
            assert_same(pipe.chat(conversation, GREEDY)[0], pipes[1].chat(conversation, GREEDY)[0])
        assert pipe.stats()["prefix_cache"]["first_tokens"] == 2
    finally:
        pipe.close()
