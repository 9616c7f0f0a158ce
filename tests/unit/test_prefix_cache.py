"""Prefix caching: with the cache on, every answer equals the cache-off engine's (float32 greedy
tokens, log-probabilities to rounding), while the cached part of each prompt is not prefilled
again; the key keeps different images, salts and evicted pages apart."""

from __future__ import annotations

import pytest

from mmpipe import Pipeline, SamplingParams
from mmpipe.engine.kv_pages import PageAllocator
from tests.helpers import random_image
from tests.unit.test_decode_graphs import simulated_graphs  # noqa: F401  (a fixture)
from tests.unit.test_prefill_graphs import simulated_piece_graphs  # noqa: F401  (a fixture)

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0, logprobs=3)
IMAGE_A, IMAGE_B = random_image(200, 150, seed=11), random_image(200, 150, seed=12)  # one size: same tokens


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": p} if not isinstance(p, str)
                                        else {"type": "text", "text": p} for p in parts]}


def assert_same(ours, reference) -> None:
    assert ours.error is None and reference.error is None
    assert ours.token_ids == reference.token_ids
    assert (ours.logprobs is None) == (reference.logprobs is None)
    for a, b in zip(ours.logprobs or [], reference.logprobs or []):
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) <= 1e-5


@pytest.fixture(scope="module")
def pipes(checkpoint):
    """The same engine with the cache on and off (small pages: prompts span many)."""
    on = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE)
    off = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, prefix_caching=False)
    yield on, off
    on.close()
    off.close()


@pytest.fixture
def on(pipes):
    pipes[0].reset_prefix_cache()
    return pipes[0]


def image_span(pipe, conversation) -> tuple[int, int]:
    request = pipe.processor.build(0, *pipe.processor.render_chat(conversation, "t"), GREEDY, "t")
    return request.image_starts[0], request.image_starts[0] + request.images[0].num_tokens


def test_a_conversation_prefills_each_earlier_turn_once(pipes, on):
    off = pipes[1]
    conversation = [user(IMAGE_A, "Describe this image.")]
    for turn in range(3):
        before = (on.runner.stats.images_encoded, on.engine.cache.hits + on.engine.cache.misses,
                  on.runner.stats.prefill_tokens)
        reused = on.engine.scheduler.key_memo.reused_pages
        ours, reference = on.chat(conversation, GREEDY)[0], off.chat(conversation, GREEDY)[0]
        assert_same(ours, reference)
        if turn:  # everything before this turn's new text was cached, the image included
            assert ours.num_cached_tokens >= image_span(on, conversation)[1]
            # the keys of the pages the last turn's prompt shares were taken, not hashed again
            assert 0 < on.engine.scheduler.key_memo.reused_pages - reused <= ours.num_cached_tokens // PAGE
            assert (on.runner.stats.images_encoded, on.engine.cache.hits + on.engine.cache.misses) == before[:2]
            assert on.runner.stats.prefill_tokens - before[2] == ours.num_prompt_tokens - ours.num_cached_tokens
        conversation = conversation + [{"role": "assistant", "content": ours.text}, user(f"And then? ({turn})")]
    stats = on.stats()["prefix_cache"]
    assert stats["enabled"] and stats["hits"] == 2 and 0 < stats["cached_share"] < 1


def test_an_identical_request_prefills_only_its_last_page(pipes, on):
    conversation = [user(IMAGE_A, "What is in the picture?")]
    first, again = on.chat(conversation, GREEDY)[0], on.chat(conversation, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (again.num_prompt_tokens - 1) // PAGE * PAGE  # its last token is computed
    assert_same(again, pipes[1].chat(conversation, GREEDY)[0])
    long = [user(IMAGE_A, "Describe this image. " * 60)]  # its keys are hashed in several batches
    on.chat(long, GREEDY)
    repeat = on.chat(long, GREEDY)[0]
    assert repeat.num_prompt_tokens > 64 * PAGE + PAGE
    assert repeat.num_cached_tokens == (repeat.num_prompt_tokens - 1) // PAGE * PAGE


def test_the_same_image_with_a_new_question_reuses_the_image(pipes, on):
    on.chat([user(IMAGE_A, "What is in the picture?")], GREEDY)
    conversation = [user(IMAGE_A, "Which colours dominate it?")]
    ours = on.chat(conversation, GREEDY)[0]
    assert ours.num_cached_tokens >= image_span(on, conversation)[1] // PAGE * PAGE
    assert_same(ours, pipes[1].chat(conversation, GREEDY)[0])


def test_two_images_with_the_same_text_share_nothing_past_the_first_image_token(pipes, on):
    """Both images have the same size, so the same token ids and positions: only the image
    hash in the key keeps the second from reading the first one's pages."""
    off = pipes[1]
    a, b = [user(IMAGE_A, "Describe this image.")], [user(IMAGE_B, "Describe this image.")]
    assert off.chat(a, GREEDY)[0].token_ids != off.chat(b, GREEDY)[0].token_ids  # the images matter
    on.chat(a, GREEDY)
    ours = on.chat(b, GREEDY)[0]
    assert ours.num_cached_tokens <= image_span(on, b)[0]
    assert_same(ours, off.chat(b, GREEDY)[0])


def test_a_cached_prefix_that_ends_inside_an_image(checkpoint, pipes):
    """A request aborted after a prompt chunk that ended inside its image leaves the pages before
    the cut cached; the same request then starts its prefill mid-image."""
    conversation = [user(IMAGE_A, "Describe this image.")]
    first, end = image_span(pipes[1], conversation)
    cut = (first + end) // 2 // PAGE * PAGE + PAGE // 2  # not on a page boundary
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, max_prefill_tokens=cut)
    request = pipe.processor.build(0, *pipe.processor.render_chat(conversation, "t"), GREEDY, "t")
    pipe.engine.add(request)
    pipe.engine.step()
    assert request.num_computed == cut
    pipe.engine.abort(request)
    ours = pipe.chat(conversation, GREEDY)[0]
    assert first < ours.num_cached_tokens == cut // PAGE * PAGE < end
    assert_same(ours, pipes[1].chat(conversation, GREEDY)[0])
    pipe.close()


def test_a_request_that_holds_keys_of_all_its_pages_still_computes_its_last_token(pipes, on):
    """A request requeued after a failed step has its in-flight token dropped but keeps the keys
    it computed with it: with its whole prompt cached, admission must still leave its last token
    to compute (its logits give the next token), or it would wait forever."""
    from mmpipe.engine.prefix_keys import extend_keys

    text = "Describe this image"
    while True:
        conversation = [user(IMAGE_A, text)]
        probe = on.processor.build(0, *on.processor.render_chat(conversation, "t"), GREEDY, "t")
        if probe.prompt_len % PAGE == 0:
            break
        text += "!"
    first = on.chat(conversation, GREEDY)[0]  # every full page of the prompt cached
    extend_keys(probe, probe.prompt_len // PAGE, PAGE)  # keys of every page, the last one included
    on.engine.add(probe)
    with on.engine.lock:
        while not probe.finished:
            on.engine.step()
    assert probe.output_ids == first.token_ids


def test_a_salt_keeps_cache_entries_apart(on):
    conversation = [user(IMAGE_A, "Describe this image.")]
    salted = [SamplingParams(max_new_tokens=2, temperature=0.0, cache_salt=salt) for salt in ("alice", "bob")]
    on.chat(conversation, salted[0])
    assert on.chat(conversation, salted[1])[0].num_cached_tokens == 0
    assert on.chat(conversation, SamplingParams(max_new_tokens=2, temperature=0.0))[0].num_cached_tokens == 0
    assert on.chat(conversation, salted[0])[0].num_cached_tokens > 0


def test_preemption_and_eviction_in_a_small_pool_change_no_answer(checkpoint, pipes):
    """A pool too small for the batch: requests are preempted (their pages stay cached), cached
    pages are evicted and handed to other requests, and a request whose pages were evicted and
    reused gets its own answer, not one read from another request's pages."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, num_kv_pages=60)
    repeated = [user(IMAGE_A, "Describe this image.")]
    first = pipe.chat(repeated, GREEDY)[0]
    crowd = [[user(random_image(120 + 8 * i, 90, seed=40 + i), f"Picture {i}: describe it in detail.")]
             for i in range(6)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0, logprobs=3)
    for ours, reference in zip(pipe.chat(crowd + [repeated], [params] * 6 + [GREEDY]),
                               pipes[1].chat(crowd + [repeated], [params] * 6 + [GREEDY])):
        assert_same(ours, reference)
    stats = pipe.stats()
    assert stats["requests"]["preemptions"] > 0 and stats["prefix_cache"]["evictions"] > 0
    assert_same(pipe.chat(repeated, GREEDY)[0], first)
    pipe.close()


def test_a_failed_step_forgets_the_pages_its_requests_registered(checkpoint, pipes):
    """Pages registered by a step whose tokens never arrived may hold half-written K/V: after the
    failure they are no longer found, and the retried request still gets the right answer."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, overlap_schedule=True)
    conversation = [user(IMAGE_A, "Describe this image.")]
    request = pipe.processor.build(0, *pipe.processor.render_chat(conversation, "t"), GREEDY, "t")
    pipe.engine.add(request)
    while not (request.pending and request.pending_decode):  # until a decode step is in flight
        pipe.engine.step()
    assert pipe.runner.pages.num_cached > 0
    launch = pipe.runner.launch_decode

    def broken(requests):
        raise RuntimeError("device lost")

    pipe.runner.launch_decode = broken
    with pytest.raises(RuntimeError):
        pipe.engine.step()
    assert pipe.runner.pages.num_cached == 0
    pipe.runner.launch_decode = launch
    while pipe.engine.scheduler.num_unfinished:
        pipe.engine.step()
    assert request.output_ids == pipes[1].chat(conversation, GREEDY)[0].token_ids
    pipe.close()


def test_the_page_allocator_holds_shares_and_evicts_least_recently_used_tails_first():
    pages = PageAllocator(8)  # 7 usable
    chain = pages.allocate(3)
    for page, key in zip(chain, (b"a", b"b", b"c")):
        assert pages.register(page, key)
    assert not pages.register(chain[0], b"z") and not pages.register(pages.allocate(1)[0], b"a")
    pages.hold([pages.lookup(b"a")])  # a second holder of the head
    pages.free(chain)
    assert pages.num_free == 7 - 2 and pages.num_cached == 3  # the head is still held; the rest cached
    assert pages.find([b"a", b"b", b"x", b"c"]) == chain[:2]  # the leading keys cached, to the first miss
    assert pages.unheld(chain) == 2 and pages.unheld(chain[:1]) == 0
    taken = pages.allocate(4)  # 3 never-cached pages, then the least recently freed cached one: c
    assert chain[2] in taken and pages.lookup(b"c") is None and pages.lookup(b"b") == chain[1]
    assert pages.evictions == 1 and pages.num_free == 1  # b, cached and unheld
    pages.free([chain[0]])
    assert pages.clear_cache() == 2 and pages.num_free == 2 and pages.lookup(b"a") is None


def conversation_turns(pipe, reference, first_turn: dict, turns: int = 3) -> list:
    """Each turn through both pipelines (answers compared); the cache-on outputs."""
    conversation, outputs = [first_turn], []
    for turn in range(turns):
        ours, expected = pipe.chat(conversation, GREEDY)[0], reference.chat(conversation, GREEDY)[0]
        assert_same(ours, expected)
        outputs.append(ours)
        conversation = conversation + [{"role": "assistant", "content": ours.text}, user(f"More, please ({turn}).")]
    assert all(o.num_cached_tokens > 0 for o in outputs[1:])
    return outputs


@pytest.mark.parametrize("graphs", ["simulated_graphs", "simulated_piece_graphs"], ids=["decode", "piecewise"])
def test_graph_modes_with_the_cache_equal_eager_without(checkpoint, pipes, graphs, request):
    """Decode graphs, or prefill pieces replayed for prompts that start at a cached offset."""
    request.getfixturevalue(graphs)
    from mmpipe.config import GraphConfig

    kind = {"simulated_graphs": "decode_graph", "simulated_piece_graphs": "prefill_graph"}[graphs]
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE,
                                    **{kind: GraphConfig(buckets=(1, 2, 4) if kind == "decode_graph" else (16, 32, 64))})
    conversation_turns(pipe, pipes[1], user(IMAGE_A, "Describe this image."))
    part = pipe.stats()["decode" if kind == "decode_graph" else "prefill"]
    assert part["replays" if kind == "decode_graph" else "graph_runs"] > 0
    pipe.close()


def rows_like_the_cuda_backend(monkeypatch) -> None:
    """The reference backend takes the CUDA backend's decision to run a short extend over a
    longer cached context as decode rows (its own attention serves decode rows too)."""
    from mmpipe.language.attention.torch_backend import TorchLMAttention

    monkeypatch.setattr(TorchLMAttention, "rows_fit", lambda self, query_len, seq_len, sequences, heads, device: (
        query_len <= 64 and seq_len >= 2 * query_len))


@pytest.mark.usefixtures("simulated_piece_graphs")
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_short_turns_over_a_cached_conversation_replay_one_graph_as_decode_rows(checkpoint_factory, monkeypatch, family):
    """A turn whose new tokens fit a row graph (text alone, or a new image's tokens with Qwen3-VL's
    deepstack rows) runs its whole forward as one graph, each token a decode row; the answers
    equal the cache-off eager engine's."""
    from mmpipe.config import GraphConfig

    rows_like_the_cuda_backend(monkeypatch)
    path = checkpoint_factory(family=family)
    pipe = Pipeline.from_pretrained(path, device="cpu", kv_page_size=PAGE, prefill_graph=GraphConfig(buckets=(8, 16, 64, 256)))
    off = Pipeline.from_pretrained(path, device="cpu", kv_page_size=PAGE, prefix_caching=False)
    prefiller = pipe.runner.prefiller
    assert prefiller.rows.cache.memory is prefiller.cache.memory and not prefiller.rows.cache.owns_memory
    small = random_image(56, 84, seed=13)  # a few image tokens: the turn still fits 64 rows
    conversation = [user(IMAGE_A, "Describe this image.")]
    try:
        for turn, question in enumerate([user("And then?"), user(small, "And this one?"), user("Why?"), None]):
            runs = pipe.stats()["prefill"]["detail"]["row_graph_runs"]
            ours, expected = pipe.chat(conversation, GREEDY)[0], off.chat(conversation, GREEDY)[0]
            assert_same(ours, expected)
            new = ours.num_prompt_tokens - ours.num_cached_tokens
            assert pipe.stats()["prefill"]["detail"]["row_graph_runs"] == runs + (turn > 0 and new <= 64)
            rows, size = prefiller.rows, prefiller.rows.size_for(new)  # the graph staged its rows: the step's, then padding
            if turn > 0 and new <= 64:
                assert (rows.seqs[:new] == 0).all() and (rows.seqs[new:size] == -1).all()
                assert (rows.lens[new:size] == 1).all() and (prefiller.slots[new:size] == prefiller.dummy_slot).all()
                assert rows.lens[:new].tolist() == list(range(ours.num_prompt_tokens - new + 1, ours.num_prompt_tokens + 1))
            conversation += [{"role": "assistant", "content": ours.text}, question]
        assert pipe.stats()["prefill"]["detail"]["row_graph_runs"] == 3
    finally:
        pipe.close()
        off.close()


@pytest.mark.usefixtures("simulated_piece_graphs")
def test_two_conversations_next_turns_share_one_row_graph_step(checkpoint_factory, monkeypatch):
    """Two chats' next turns admitted together: one row graph step holds both sequences (each row
    its own sequence's pages and keys) and both first tokens come from its logit rows."""
    from mmpipe.config import GraphConfig

    rows_like_the_cuda_backend(monkeypatch)
    path = checkpoint_factory()
    pipe = Pipeline.from_pretrained(path, device="cpu", kv_page_size=PAGE, prefill_graph=GraphConfig(buckets=(8, 16, 64, 256)))
    off = Pipeline.from_pretrained(path, device="cpu", kv_page_size=PAGE, prefix_caching=False)
    try:
        chats = [[user(IMAGE_A, "Describe this image.")], [user(IMAGE_B, "What is in this picture?")]]
        for chat, first in zip(chats, pipe.chat(chats, GREEDY)):
            chat += [{"role": "assistant", "content": first.text}, user("Why?")]
        runs = pipe.stats()["prefill"]["detail"]["row_graph_runs"]
        requests = [pipe.processor.build(i, *pipe.processor.render_chat(chat, "t"), GREEDY, "t")
                    for i, chat in enumerate(chats)]
        with pipe.engine.lock:  # both in the engine before its first step: one prefill step
            for request in requests:
                pipe.engine.add(request)
            while not all(request.finished for request in requests):
                pipe.engine.step()
        ours = [request.to_output() for request in requests]
        assert pipe.stats()["prefill"]["detail"]["row_graph_runs"] == runs + 1
        assert sum(o.num_prompt_tokens - o.num_cached_tokens for o in ours) <= 64
        for mine, expected in zip(ours, off.chat(chats, GREEDY)):
            assert_same(mine, expected)
        assert ours[0].token_ids != ours[1].token_ids
    finally:
        pipe.close()
        off.close()


def test_qwen3_vl_deepstack_rows_after_a_cached_prefix(checkpoint_factory):
    """Qwen3-VL adds the image's deepstack features in early layers: a turn whose image is cached
    must not need them, and one whose prefix ends inside the image must add the right rows."""
    path = checkpoint_factory(family="qwen3_vl")
    on = Pipeline.from_pretrained(path, device="cpu", kv_page_size=PAGE)
    off = Pipeline.from_pretrained(path, device="cpu", kv_page_size=PAGE, prefix_caching=False)
    conversation_turns(on, off, user(IMAGE_A, "Describe this image."), turns=2)
    on.close()
    off.close()


def test_a_video_conversation_reuses_its_frames(pipes, on, tmp_path):
    """Frame groups are keyed like images (their pixel hashes); positions carry the timestamps."""
    from tests.video_helpers import make_video

    clip = make_video(tmp_path / "clip.mp4", 12, 96, 72, fps=6)
    outputs = conversation_turns(on, pipes[1], {"role": "user", "content": [
        {"type": "video", "video": clip, "nframes": 4}, {"type": "text", "text": "What happens?"}]}, turns=2)
    assert outputs[1].num_cached_tokens > outputs[1].num_prompt_tokens // 2


def test_two_ranks_read_the_cached_pages_rank_0_found(checkpoint, pipes):
    """Rank 0 schedules: the other rank computes into and reads the very pages it names."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=PAGE, tensor_parallel_size=2)
    try:
        conversation_turns(pipe, pipes[1], user(IMAGE_A, "Describe this image."), turns=2)
    finally:
        pipe.close()


def test_an_extend_steps_tokens_as_decode_rows_see_their_prefix_and_the_tokens_before_them():
    """The rows the CUDA backend runs through the rows kernel: page-table row, key count and
    sequence of each real query token (sequences without new tokens and padding rows have none),
    the same from the device tensors and from the host inputs a short step uploads."""
    import numpy as np
    import torch
    from mmpipe.language.attention.metadata import AttentionMetadata, decode_rows, host_decode_rows

    seqs = [(1500, 3), (0, 0), (17, 2), (5, 1)]
    lens, new = [a + b for a, b in seqs], [b for _, b in seqs]
    table = np.arange(20, dtype=np.int32).reshape(5, 4)  # row i: the pages of sequence i
    starts = torch.tensor([0, 3, 3, 5, 6, 6], dtype=torch.int32)  # and a padding sequence
    meta = AttentionMetadata(is_decode=False, num_tokens=8, slot_mapping=torch.zeros(8, dtype=torch.long),
                             seq_lens=torch.tensor([*lens, 0], dtype=torch.int32), query_start_loc=starts,
                             page_table=torch.from_numpy(table), seq_lens_host=lens,
                             query_lens_host=new, max_query_len=3, max_seq_len=1503)
    rows, keys, owners = decode_rows(meta)
    assert rows.tolist() == table[[0, 0, 0, 2, 2, 3]].tolist() and keys.tolist() == [1501, 1502, 1503, 18, 19, 6]
    assert owners.tolist() == [0, 0, 0, 2, 2, 3] and owners.dtype == torch.int32
    host_rows, host_keys, host_owners = host_decode_rows(new, lens, table[:4])
    assert host_rows.tolist() == rows.tolist() and host_keys.tolist() == keys.tolist()
    assert host_owners.tolist() == owners.tolist()
    assert host_rows.dtype == np.int32 and host_keys.dtype == np.int32 and host_owners.dtype == np.int32


class _Stub:
    """What `extend_keys` reads of a request: 12 tokens, one image of 2 tokens inside a page."""

    def __init__(self, image_key: str, salt: str | None = None) -> None:
        from types import SimpleNamespace

        import numpy as np

        self.ids = list(range(100, 112))
        self.pos = np.tile(np.arange(12), (3, 1))
        self.image_starts = [5]
        self.images = [SimpleNamespace(key=image_key, num_tokens=2)]
        self.sampling = SimpleNamespace(cache_salt=salt)
        self.cache_keys: list[bytes] = []

    def tokens(self, start: int, end: int) -> list[int]:
        return self.ids[start:end]

    def positions_of(self, start: int, end: int):
        return self.pos[:, start:end]


def test_a_page_key_covers_an_image_wholly_inside_the_page_and_the_salt():
    from mmpipe.engine.prefix_keys import extend_keys

    a, b, salted = extend_keys(_Stub("A"), 3, 4), extend_keys(_Stub("B"), 3, 4), extend_keys(_Stub("A", "s"), 3, 4)
    assert a[0] == b[0] and a[1] != b[1]  # the image's tokens 5 and 6 are in page 1 alone
    assert all(x != y for x, y in zip(a, salted))
    again = _Stub("A")
    extend_keys(again, 1, 4)
    assert extend_keys(again, 3, 4) == a  # computed in two calls: the same chain
