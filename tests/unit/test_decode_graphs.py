"""The decode runner's host side on the CPU: buckets and modes, the persistent device batch kept in
step with the requests (joins, leaves, moves, page growth, padding rows), sampling inside the step
against transformers, the shared graph cache's bookkeeping, and per-thread forward contexts."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from mmpipe.language.decode_graphs import default_decode_buckets
from mmpipe.language.kv_cache import DUMMY_PAGE

from mmpipe import EngineConfig, GraphConfig, GraphMode, InputError, Pipeline, SamplingParams
from mmpipe.config import effective_graph_mode, graphs_wanted
from mmpipe.graphs import cache as graph_cache_module
from mmpipe.graphs import runner as graph_runner_module
from mmpipe.graphs.cache import bucket_for
from mmpipe.graphs.runner import GraphRunner
from mmpipe.graphs.transfer import PackedUploader
from tests.helpers import hf_inputs, hf_model, make_checkpoint

CPU = torch.device("cpu")
CUDA_LIKE = torch.device("cuda", 0)


# ---------------------------------------------------------------------------- buckets and modes

def test_default_decode_buckets():
    buckets = default_decode_buckets(256)
    assert buckets[:7] == [1, 2, 4, 8, 16, 24, 32]
    assert buckets[7:] == list(range(48, 257, 16))
    assert default_decode_buckets(20) == [1, 2, 4, 8, 16, 20]  # the cap is always a bucket
    assert default_decode_buckets(300)[-3:] == [256, 288, 300]


@pytest.mark.parametrize("size, bucket", [(1, 1), (3, 4), (4, 4), (5, 8), (25, 32), (32, 32), (33, None)])
def test_bucket_choice(size, bucket):
    assert bucket_for([1, 2, 4, 8, 16, 24, 32], size) == bucket


def test_graph_modes():
    assert effective_graph_mode(None, CUDA_LIKE) is GraphMode.FULL_AND_PIECEWISE
    assert effective_graph_mode(None, CPU) is GraphMode.NONE
    assert effective_graph_mode(GraphMode.PIECEWISE, CPU) is GraphMode.NONE  # nothing to capture on a CPU
    assert EngineConfig(graph_mode="FULL_DECODE_ONLY").graph_mode is GraphMode.FULL_DECODE_ONLY  # parsed once
    assert effective_graph_mode(GraphMode.FULL_DECODE_ONLY, CUDA_LIKE) is GraphMode.FULL_DECODE_ONLY
    with pytest.raises(InputError, match="full_decode_only"):  # the old duplicate name points at its twin
        EngineConfig(graph_mode="full")
    # One behaviour per name: which runners ask for graphs, when their configs leave it to the mode.
    auto = GraphConfig()
    behaviours = {m: tuple(r for r in ("vit", "decode", "prefill") if graphs_wanted(m, r, auto)) for m in GraphMode}
    assert behaviours == {GraphMode.NONE: (), GraphMode.PIECEWISE: ("vit", "prefill"),
                          GraphMode.FULL_DECODE_ONLY: ("vit", "decode"),
                          GraphMode.FULL_AND_PIECEWISE: ("vit", "decode", "prefill")}
    # A runner's own setting wins over the mode, both ways.
    assert graphs_wanted(GraphMode.NONE, "vit", GraphConfig(enabled=True))
    assert not graphs_wanted(GraphMode.FULL_AND_PIECEWISE, "decode", GraphConfig(enabled=False))
    with pytest.raises(InputError, match="graph_mode='fast'"):
        GraphMode.parse("fast")
    with pytest.raises(InputError, match="graph_mode"):
        EngineConfig(graph_mode="everything")


def test_graph_config_validation():
    assert GraphConfig(buckets=(8, 2, 2, 4)).buckets == (2, 4, 8)
    for bad in (dict(buckets=()), dict(buckets=(0, 4)), dict(memory="heap"), dict(max_graphs=0),
                dict(enabled="yes")):
        with pytest.raises(InputError, match="GraphConfig"):
            GraphConfig(**bad)
    with pytest.raises(InputError, match="decode_graph"):
        EngineConfig(decode_graph={"enabled": True})


def test_cpu_pipeline_reports_graph_stats(pipe):
    stats = pipe.stats()
    assert stats["graph_mode"] == "none"
    assert stats["decode"]["enabled"] is False and stats["vit"]["enabled"] is False
    before = stats["runner"]["decode_steps"]
    pipe.chat([{"role": "user", "content": "hello"}], SamplingParams(max_new_tokens=4, ignore_eos=True))
    after = pipe.stats()["runner"]
    assert after["decode_steps"] == before + 3 and after["decode_host_seconds"] > 0


# ---------------------------------------------------------------------------- the persistent batch

def check_rows(decoder) -> None:
    """Every row agrees with its request; every row past the batch is padding."""
    ps = decoder.page_size
    size = decoder.size
    for row in range(decoder.max_rows):
        request = decoder.requests[row]
        if row >= size:
            assert request is None
            assert decoder.seq_lens[row].item() == 1 and not decoder.active[row].item()
            assert (decoder.page_table[row] == DUMMY_PAGE).all()
            assert decoder.sampler.temperature[row].item() == 0 and decoder.sampler.penalty[row].item() == 1
            assert not decoder.sampler.seen[row].any()
            continue
        if request is None:  # released when its request finished; reused or reset at the next step
            continue
        assert decoder.active[row].item() and not request.finished
        if not request.pending:  # else (overlapped steps) the row feeds the token in flight
            assert decoder.input_ids[row].item() == request.output_ids[-1]
        assert request.pending == 0 or request.pending_decode
        assert decoder.seq_lens[row].item() == request.seq_len
        assert decoder.sampler.steps[row].item() == len(request.output_ids) + request.pending
        pages = -(-(request.seq_len - 1) // ps)  # the newest token's page comes with its step
        assert decoder.page_table[row, :pages].tolist() == request.pages[:pages]


@pytest.mark.parametrize("overlap", [False, True])
def test_rows_follow_joins_leaves_and_page_growth(checkpoint, overlap):
    """Requests of different lengths join at different steps and finish at different steps, with
    4-token pages so they gain pages while decoding; after every step the device rows match (with
    overlapped steps: counting each request's token in flight)."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=4, max_prefill_tokens=40,
                                    overlap_schedule=overlap)
    engine, decoder = pipe.engine, pipe.runner.decoder
    prompts = ["tell me", "tell me about the picture in a few words", "a", "please be brief about it now"]
    requests = []
    for i in range(12):
        params = SamplingParams(max_new_tokens=2 + (i * 5) % 11, ignore_eos=True, temperature=0.0,
                                repetition_penalty=1.3 if i % 3 == 0 else None, seed=i)
        conversation = [{"role": "user", "content": prompts[i % 4]}]
        requests.append(pipe.processor.build(i, *pipe.processor.render_chat(conversation, "t"), params, "t"))
    pending = list(requests)
    steps = 0
    while pending or engine.scheduler.num_unfinished:
        if pending and steps % 2 == 0:  # staggered arrivals
            engine.add(pending.pop(0))
        engine.step()
        check_rows(decoder)
        steps += 1
    assert decoder.batch_stats.rows_moved > 0 and decoder.batch_stats.pages_appended > 0
    assert all(r is None for r in decoder.requests) and not decoder.row_of  # nothing kept alive
    alone = [pipe.chat([{"role": "user", "content": prompts[i % 4]}], SamplingParams(
        max_new_tokens=2 + (i * 5) % 11, ignore_eos=True, temperature=0.0,
        repetition_penalty=1.3 if i % 3 == 0 else None, seed=i))[0].token_ids for i in range(12)]
    assert [r.output_ids for r in requests] == alone


@pytest.mark.parametrize("overlap", [False, True])
def test_a_steady_batch_grows_its_pages(checkpoint, overlap):
    """The same requests step after step (the fast path): their page-table rows still gain each
    new page, and every step's tokens equal running each request alone."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", kv_page_size=4, overlap_schedule=overlap)
    conversations = [[{"role": "user", "content": "tell me " * (1 + i)}] for i in range(3)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0)
    requests = [pipe.processor.build(i, *pipe.processor.render_chat(c, "t"), params, "t")
                for i, c in enumerate(conversations)]
    for request in requests:
        pipe.engine.add(request)
    appended = pipe.runner.decoder.batch_stats.pages_appended
    while pipe.engine.scheduler.num_unfinished:
        pipe.engine.step()
        check_rows(pipe.runner.decoder)
    assert pipe.runner.decoder.batch_stats.pages_appended >= appended + 3 * 4
    assert [r.output_ids for r in requests] == [o.token_ids for o in pipe.chat(conversations, params)]


def test_a_failed_step_resets_the_rows(checkpoint):
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    decoder = pipe.runner.decoder
    original = decoder.lm.compute_logits
    calls = {"n": 0}

    def flaky(hidden):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected")
        return original(hidden)

    decoder.lm.compute_logits = flaky
    try:
        with pytest.raises(RuntimeError, match="injected"):
            pipe.chat([[{"role": "user", "content": "tell me"}]] * 3, SamplingParams(max_new_tokens=6, ignore_eos=True),
                      errors="raise")
    finally:
        decoder.lm.compute_logits = original
    check_rows(decoder)
    assert decoder.size == 0
    out = pipe.chat([[{"role": "user", "content": "tell me"}]] * 3, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in out)


# ---------------------------------------------------------------------------- sampling in the step

@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt_eos")), seed=3)


def test_repetition_penalty_and_min_new_tokens_match_transformers(eos_checkpoint):
    """The repetition mask lives on the device and is advanced inside the step; transformers'
    logits processors (over prompt + generated ids) are the oracle."""
    pipe = Pipeline.from_pretrained(eos_checkpoint, device="cpu")
    model = hf_model(eos_checkpoint)
    conversation = [{"role": "user", "content": "tell me a story about a fox"}]
    inputs = hf_inputs(eos_checkpoint, conversation)
    plain = pipe.chat(conversation, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0))[0]
    for penalty in (1.5, 0.7):
        ours = pipe.chat(conversation, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0,
                                                      repetition_penalty=penalty))[0]
        out = model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
                             eos_token_id=None, repetition_penalty=penalty, top_k=None, top_p=None,
                             temperature=None)
        assert ours.token_ids == out[0, inputs["input_ids"].shape[1]:].tolist(), penalty
        assert ours.token_ids != plain.token_ids  # the knob acts
    # min_new_tokens holds back the end-of-sequence token (transformers' MinNewTokensLength rule)
    eos = plain.token_ids[3]
    ours = pipe.chat(conversation, SamplingParams(max_new_tokens=12, min_new_tokens=8, temperature=0.0,
                                                  stop_token_ids=[eos]))[0]
    out = model.generate(**inputs, max_new_tokens=12, min_new_tokens=8, do_sample=False, pad_token_id=0,
                         eos_token_id=[eos] + list(pipe.defaults.eos_token_ids), top_k=None, top_p=None,
                         temperature=None)
    reference = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert ours.token_ids == reference[:len(ours.token_ids)]
    assert len(ours.token_ids) >= 8 and eos not in ours.token_ids[:8]


def test_seeded_sampling_in_the_step_is_independent_of_the_batch(pipe):
    """A seeded request with every knob on draws the same tokens alone, in a batch whose other
    rows sample differently, and after rows around it finish (its row moves)."""
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    knobs = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02,
                           repetition_penalty=1.2, seed=1234, logprobs=3)
    alone = pipe.chat(conversation, knobs)[0]
    others = [SamplingParams(max_new_tokens=1 + i, ignore_eos=True, temperature=0.0 if i % 2 else 1.3, seed=i)
              for i in range(7)]
    outs = pipe.chat([conversation] * 8, others[:3] + [knobs] + others[3:])
    assert outs[3].token_ids == alone.token_ids
    assert [sorted(d) for d in outs[3].logprobs] == [sorted(d) for d in alone.logprobs]
    for a, b in zip(outs[3].logprobs, alone.logprobs):
        assert all(abs(a[t] - b[t]) < 1e-5 for t in a)
    unseeded_like = pipe.chat(conversation, SamplingParams(**{**knobs.__dict__, "seed": 99}))[0]
    assert unseeded_like.token_ids != alone.token_ids  # the seed matters


# ---------------------------------------------------------------------------- the graph cache

class FakeGraph:
    log: list[str] = []

    def __init__(self, name):
        self.name = name
        self.replays = 0

    def replay(self):
        self.replays += 1

    def reset(self):
        FakeGraph.log.append(f"reset {self.name}")


class FakeMemory:
    name = "fake"

    def __init__(self):
        self.released, self.closed = [], False

    def open(self):
        return object()

    def release(self, memory):
        FakeGraph.log.append("release")
        self.released.append(memory)

    def physical_bytes(self):
        return None

    def close(self):
        FakeGraph.log.append("close")
        self.closed = True


class EchoRunner(GraphRunner):
    """The smallest graph runner: the graph for a key returns the value `outputs` holds for it."""

    def __init__(self, memory, max_graphs):
        capturable_backend = type("Backend", (), {"graph_safe": True, "name": "test"})()
        super().__init__("test", CPU, [1, 2, 3, 4], True, capturable_backend, memory, max_graphs)
        self.outputs = {}

    def body(self, key):
        return lambda: self.outputs[key]


def test_graph_runner_captures_replays_evicts_and_tears_down_in_order(monkeypatch):
    def fake_capture(body, memory, device, warmups=1, shared=None):
        output = body()
        if output == "boom":
            raise RuntimeError("capture failed")
        return FakeGraph(output), output, shared or memory.open()

    monkeypatch.setattr(graph_cache_module, "capture", fake_capture)
    monkeypatch.setattr(graph_runner_module, "can_capture_on", lambda device: True)
    FakeGraph.log = []
    memory = FakeMemory()
    runner = EchoRunner(memory, max_graphs=2)
    cache = runner.cache

    def run(key, value):
        runner.outputs[key] = value
        return runner.run(key, lambda: f"eager {value}")

    assert run(1, "one") == ("one", True)
    assert run(1, "never called") == ("one", True)  # replayed, not recaptured
    assert cache.stats.captures == 1 and cache.stats.replays == 2
    assert run(2, "boom") == ("eager boom", False)  # a failed capture falls back, never raises
    assert cache.stats.capture_failures == 1 and cache.stats.eager_fallbacks == 1
    assert run(2, "two") == ("eager two", False)  # and is not retried (each try costs a warm-up)
    assert cache.stats.capture_failures == 1 and cache.stats.eager_fallbacks == 2
    assert run(None, "none") == ("eager none", False)  # no size fits: eager
    run(4, "four")
    run(1, "one")  # 1 is now the most recently used
    run(3, "three")  # evicts 4
    assert list(cache.graphs) == [1, 3] and cache.stats.evictions == 1
    assert FakeGraph.log == ["reset four", "release"]
    stats = runner.stats()
    assert (stats["graph_runs"], stats["eager_runs"], stats["graphs"], stats["captures"]) == (5, 3, 2, 3)
    FakeGraph.log = []
    runner.close()
    assert FakeGraph.log == ["reset one", "release", "reset three", "release", "close"]
    runner.close()  # idempotent
    cache.close()
    assert FakeGraph.log.count("close") == 1 and cache.stats.graphs_live == 0


def test_capturing_a_live_key_again_destroys_the_graph_it_replaces(monkeypatch):
    """A second capture of a live key (no caller should make one) frees the first graph and its
    memory instead of dropping the reference to a graph still holding them."""
    monkeypatch.setattr(graph_cache_module, "capture",
                        lambda body, memory, device, warmups=1, shared=None: (FakeGraph(body()), body(), memory.open()))
    monkeypatch.setattr(graph_runner_module, "can_capture_on", lambda device: True)
    FakeGraph.log = []
    runner = EchoRunner(FakeMemory(), max_graphs=4)
    runner.outputs[2] = "first"
    assert runner.capture(2)
    runner.outputs[2] = "second"
    assert runner.capture(2)
    assert FakeGraph.log == ["reset first", "release"] and runner.cache.stats.graphs_live == 1
    assert runner.replay(2) == "second"
    runner.close()


# ---------------------------------------------------------------------------- threads

def test_two_pipelines_in_two_threads(checkpoint, checkpoint_factory):
    """Each thread's forward reads its own metadata and KV cache (the forward context is per
    thread); with a shared context the two models would read each other's caches."""
    other = checkpoint_factory(seed=7)
    pipes = [Pipeline.from_pretrained(path, device="cpu") for path in (checkpoint, other)]
    conversations = [[{"role": "user", "content": " ".join(["tell me about the picture"] * (1 + i % 3))}]
                     for i in range(6)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0)
    expected = [[o.token_ids for o in p.chat(conversations, params)] for p in pipes]
    assert expected[0] != expected[1]
    results: list = [None, None]
    errors: list = []

    def work(i):
        try:
            results[i] = [[o.token_ids for o in pipes[i].chat(conversations, params)] for _ in range(3)]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    for i in range(2):
        assert results[i] == [expected[i]] * 3


# ---------------------------------------------------------------------------- prefill inputs

def test_prefill_inputs_are_built_on_the_host_and_uploaded_once(pipe):
    from mmpipe.language.prefill_graphs import upload_inputs

    from mmpipe.engine.batch import PrefillChunk, build_prefill_inputs
    from tests.helpers import random_image

    image = random_image(90, 60, seed=5)
    request = pipe.processor.build(0, *pipe.processor.render_chat(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}], "t"),
        SamplingParams(max_new_tokens=2), "t")
    request.pages = [7, 3, 9, 12, 5, 6, 8, 2][: -(-request.prompt_len // pipe.runner.page_size)]
    request.image_embeds = [torch.randn(request.images[0].num_tokens, 8)]
    half = request.prompt_len // 2
    inputs = build_prefill_inputs([PrefillChunk(request, half, request.prompt_len)], pipe.runner.page_size)
    ps = pipe.runner.page_size
    index = np.arange(half, request.prompt_len)
    assert inputs.slot_mapping.tolist() == [request.pages[i // ps] * ps + i % ps for i in index]
    assert inputs.positions.tolist() == request.positions[:, half:].tolist()
    assert inputs.logit_rows.tolist() == [request.prompt_len - half - 1]
    start = request.image_starts[0]
    (span,) = inputs.images  # the image's rows in this chunk, with its values (no concatenation)
    assert span.row == start - half and span.values.data_ptr() == request.image_embeds[0].data_ptr()
    assert span.values.shape[0] == request.images[0].num_tokens - max(0, half - start)
    ids, pos, meta, rows, count = upload_inputs(inputs, PackedUploader(CPU))
    assert ids.tolist() == request.prompt_ids[half:] and pos.t().tolist() == request.positions[:, half:].tolist()
    assert count.tolist() == [len(index)] and rows.tolist() == inputs.logit_rows.tolist()
    assert meta.slot_mapping.tolist() == inputs.slot_mapping.tolist()
    assert meta.seq_lens.tolist() == [request.prompt_len] and meta.query_start_loc.tolist() == [0, len(index)]
    assert meta.page_table.dtype == torch.int32 and meta.page_table[0].tolist()[: len(request.pages)] == request.pages


def test_prefill_writes_text_and_image_rows_into_the_fixed_input_buffers(pipe):
    """The prefill reads slices of input_embeds/positions, allocated once: text rows hold the
    token embeddings, each image's rows its embeddings (rows before the chunk's start skipped)."""
    from mmpipe.language.prefill_graphs import upload_inputs

    from mmpipe.engine.batch import PrefillChunk, build_prefill_inputs
    from tests.helpers import random_image

    lm, prefiller = pipe.model.language, pipe.runner.prefiller
    image = random_image(90, 60, seed=5)
    request = pipe.processor.build(0, *pipe.processor.render_chat(
        [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "image": image},
                                      {"type": "text", "text": "hi"}]}], "t"), SamplingParams(max_new_tokens=2), "t")
    request.pages = pipe.runner.pages.allocate(-(-request.prompt_len // pipe.runner.page_size))
    tokens = request.images[0].num_tokens
    request.image_embeds = [torch.randn(tokens, lm.hidden_size, dtype=prefiller.input_embeds.dtype)]
    start = request.image_starts[0]
    cut = start + tokens // 2  # the chunk begins inside the image
    buffer_before = prefiller.input_embeds.data_ptr()
    inputs = build_prefill_inputs([PrefillChunk(request, cut, request.prompt_len)], pipe.runner.page_size)
    ids, pos, meta, _, count = upload_inputs(inputs, PackedUploader(CPU))
    prefiller.forward(ids, pos, inputs.images, meta, count)
    n = request.prompt_len - cut
    image_part = tokens - tokens // 2
    assert torch.equal(prefiller.input_embeds[:image_part], request.image_embeds[0][tokens // 2:])
    text = torch.tensor(request.prompt_ids[start + tokens:])
    assert torch.equal(prefiller.input_embeds[image_part:n], lm.embed(text))
    assert torch.equal(prefiller.positions[:n].t(), torch.as_tensor(request.positions[:, cut:]))
    assert prefiller.input_embeds.data_ptr() == buffer_before
    pipe.runner.pages.free(request.pages)


# ---------------------------------------------------------------------------- failures and stale rows

def test_a_failure_after_a_request_finished_does_not_run_it_again(checkpoint):
    """A step fails after one of its requests finished (here: its completion callback raises):
    that request stays finished with exactly its tokens and frees its pages; the others are
    recomputed and complete."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    conversation = [{"role": "user", "content": "tell me"}]
    short, long_ = (pipe.processor.build(i, *pipe.processor.render_chat(conversation, "t"),
                                         SamplingParams(max_new_tokens=n, ignore_eos=True), "t")
                    for i, n in enumerate((3, 8)))
    calls = []

    def explode(request):
        calls.append(request)
        raise RuntimeError("callback failed")

    short.on_finish = explode
    for request in (short, long_):
        pipe.engine.add(request)
    with pytest.raises(RuntimeError, match="callback failed"):
        while True:
            pipe.engine.step()
    while pipe.engine.scheduler.num_unfinished:
        pipe.engine.step()
    assert len(short.output_ids) == 3 and short.finish_reason == "length" and len(calls) == 1
    assert len(long_.output_ids) == 8
    assert pipe.runner.pages.num_free == pipe.runner.pages.capacity
    assert not pipe.runner.decoder.row_of


def test_aborted_and_preempted_requests_leave_the_decode_batch(pipe):
    conversation = [{"role": "user", "content": "tell me"}]
    requests = [pipe.processor.build(i, *pipe.processor.render_chat(conversation, "t"),
                                     SamplingParams(max_new_tokens=20, ignore_eos=True), "t") for i in range(3)]
    for request in requests:
        pipe.engine.add(request)
    for _ in range(3):
        pipe.engine.step()
    decoder = pipe.runner.decoder
    assert len(decoder.row_of) == 3
    pipe.engine.abort(requests[1])
    assert id(requests[1]) not in decoder.row_of and len(decoder.row_of) == 2  # no reference kept
    for request in (requests[0], requests[2]):
        pipe.engine.abort(request)
    assert not decoder.row_of


def test_a_row_out_of_step_with_its_request_is_rewritten(checkpoint):
    """The engine releases rows on every path that recomputes a request; as a safety net the
    decode batch itself rewrites a row whose request is not exactly one token past it (here: the
    request is cut back two tokens behind the runner's back, as a recompute would leave it)."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", overlap_schedule=False)  # no token in flight
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    request = pipe.processor.build(0, *pipe.processor.render_chat(conversation, "t"),
                                   SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0), "t")
    pipe.engine.add(request)
    for _ in range(4):
        pipe.engine.step()
    decoder = pipe.runner.decoder
    written = decoder.batch_stats.rows_written
    del request.output_ids[-2:]
    request.num_computed = request.total_len - 1
    pipe.runner.apply_tokens([request], pipe.runner.launch_decode([request]).get())
    assert decoder.batch_stats.rows_written == written + 1
    check_rows(decoder)


# ---------------------------------------------------------------------------- the graph path, simulated

class ReplayingGraph:
    """Stands in for a CUDA graph on the CPU: a replay runs the captured body again and writes its
    results into the tensors the capture returned (as a real replay writes its static outputs)."""

    def __init__(self, body, output):
        self.body, self.output = body, output

    def replay(self):
        fresh = self.body()
        if isinstance(self.output, torch.Tensor):  # a constrained step's forward: its logits buffer
            self.output.copy_(fresh)
            return
        for name in ("tokens", "token_logprobs", "top_ids", "top_logprobs"):
            target = getattr(self.output, name)
            if target is not None:
                target.copy_(getattr(fresh, name))

    def reset(self):
        pass


@pytest.fixture
def simulated_graphs(monkeypatch):
    """Decode graphs on the CPU: the engine believes graphs are on; captures replay the body."""
    from mmpipe.language.attention.torch_backend import TorchLMAttention

    from mmpipe.engine import model_runner

    def fake_capture(body, memory, device, warmups=1, shared=None):
        for _ in range(warmups):
            body()
        output = body()
        return ReplayingGraph(body, output), output, None

    monkeypatch.setattr(graph_cache_module, "capture", fake_capture)
    monkeypatch.setattr(graph_runner_module, "make_graph_memory", lambda kind, device: FakeMemory())
    monkeypatch.setattr(model_runner, "SharedPool", FakeMemory)
    monkeypatch.setattr(model_runner, "effective_graph_mode", lambda mode, device: GraphMode.FULL_DECODE_ONLY)
    monkeypatch.setattr(graph_runner_module, "can_capture_on", lambda device: True)
    monkeypatch.setattr(TorchLMAttention, "graph_safe", True)


def test_the_graph_path_equals_eager_with_padding_variants_and_fallbacks(checkpoint, simulated_graphs):
    """Buckets (1, 2, 4) with up to 6 requests: exact, padded and above-the-largest batches, lazily
    captured sampler variants (with their inactive warm-up), all equal to eager decoding."""
    graphs = Pipeline.from_pretrained(checkpoint, device="cpu", max_running_requests=6,
                                      decode_graph=GraphConfig(buckets=(1, 2, 4), max_graphs=8))
    eager = Pipeline.from_pretrained(checkpoint, device="cpu", max_running_requests=6,
                                     decode_graph=GraphConfig(enabled=False))
    assert graphs.stats()["decode"]["captures"] == 3  # 1, 2, 4 (greedy); 5 or 6 rows run eagerly
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    params = [SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             top_p=0.9, repetition_penalty=1.2 if i == 2 else None, seed=i, logprobs=2)
              for i in range(6)]
    for count in (3, 6):
        ours = graphs.chat([conversation] * count, params[:count])
        reference = eager.chat([conversation] * count, params[:count])
        assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
        for a, b in zip(ours, reference):  # padded rows change the matmul blocking: rounding only
            for da, db in zip(a.logprobs, b.logprobs):
                assert da.keys() == db.keys() and max(abs(da[t] - db[t]) for t in da) < 1e-5
    decode = graphs.stats()["decode"]
    assert decode["graph_runs"] > 0 and decode["captures"] > 3  # sampling variants captured lazily
    assert decode["eager_runs"] > 0 and decode["eager_fallbacks"] > 0  # 5 and 6 rows: above the largest
    assert eager.stats()["decode"]["graph_runs"] == 0
    FakeGraph.log = []


def test_covering_graphs_reuse_cheap_stages_only_and_keep_logprob_ids(checkpoint, simulated_graphs):
    """A live graph with extra cheap stages (here: the min_new_tokens ban, after it expired) serves
    a batch without capturing again; a different top-logprob count never reuses a graph (equal
    bf16 logits could be ranked differently), so every request's logprob ids equal eager's."""
    kw = dict(device="cpu", dtype="bfloat16", max_running_requests=4)
    graphs = Pipeline.from_pretrained(checkpoint, decode_graph=GraphConfig(buckets=(1, 2, 4)), **kw)
    eager = Pipeline.from_pretrained(checkpoint, decode_graph=GraphConfig(enabled=False), **kw)
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    banned = [SamplingParams(max_new_tokens=12, min_new_tokens=4, temperature=0.0, repetition_penalty=1.3,
                             stop_token_ids=[7])] * 4
    before = graphs.stats()["decode"]["captures"]
    graphs.chat([conversation] * 4, banned)
    assert graphs.stats()["decode"]["captures"] == before + 1  # penalty+ban; the ban expires: reused
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.0, logprobs=8)] + \
             [SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.0, logprobs=3)] * 3
    ours, reference = graphs.chat([conversation] * 4, params), eager.chat([conversation] * 4, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    assert [[sorted(d) for d in o.logprobs] for o in ours] == [[sorted(d) for d in o.logprobs] for o in reference]


def test_a_request_preempted_mid_prefill_is_not_prefilled_in_the_same_step(checkpoint):
    """A decoding request runs out of pages while a long prompt is half prefilled: the prompt's
    request is preempted and must not get a chunk in that step; both finish as when run alone."""
    words = " ".join("tell me about the picture in a few words please and be brief about it".split() * 2)
    decode_params = SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.0)
    prompt_params = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.0)
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", num_kv_pages=37, kv_page_size=4, max_prefill_tokens=16,
                                    overlap_schedule=False,  # the step counts below assume tokens read at once
                                    prefix_caching=False)  # else the prompts' shared template is not prefilled
    build = lambda i, text, p: pipe.processor.build(  # noqa: E731
        i, *pipe.processor.render_chat([{"role": "user", "content": text}], "t"), p, "t")
    first, second = build(0, "hi", decode_params), build(1, words, prompt_params)
    pipe.engine.add(first)
    pipe.engine.step()
    pipe.engine.step()
    pipe.engine.add(second)
    preempted_mid_prefill = []
    preempt = pipe.engine.scheduler._preempt

    def spy(request, plan):
        if request is second and 0 < second.num_computed < second.prompt_len:
            preempted_mid_prefill.append(second.num_computed)
        return preempt(request, plan)

    pipe.engine.scheduler._preempt = spy
    while pipe.engine.scheduler.num_unfinished:
        pipe.engine.step()
    assert preempted_mid_prefill  # the situation under test happened
    reference = Pipeline.from_pretrained(checkpoint, device="cpu")
    assert first.output_ids == reference.chat([{"role": "user", "content": "hi"}], decode_params)[0].token_ids
    assert second.output_ids == reference.chat([{"role": "user", "content": words}], prompt_params)[0].token_ids


def test_startup_sampling_captures_its_own_variants_instead_of_greedys(checkpoint, simulated_graphs):
    """A Pipeline told its sampling (min_new_tokens: a ban while it holds) captures that variant at
    start-up and nothing else; the ban graphs also serve the steps after the ban and greedy
    requests, so a run captures nothing more (the captioning tool's start-up)."""
    kw = dict(device="cpu", max_running_requests=4, decode_graph=GraphConfig(buckets=(1, 2, 4)))
    sampling = SamplingParams(max_new_tokens=6, min_new_tokens=3, temperature=0.0)
    pipe = Pipeline.from_pretrained(checkpoint, startup_sampling=sampling, **kw)
    decode = pipe.stats()["decode"]
    assert decode["captures"] == 3 and all(key[1].ban for key in pipe.runner.decoder.cache.live_keys())
    assert pipe.warm_up((), sampling) == 0
    eager = Pipeline.from_pretrained(checkpoint, **{**kw, "decode_graph": GraphConfig(enabled=False)})
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    greedy = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.0)
    for params in (sampling, greedy):
        ours, reference = pipe.chat([conversation] * 3, params), eager.chat([conversation] * 3, params)
        assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    after = pipe.stats()["decode"]
    assert after["captures"] == 3 and after["graph_runs"] > 0
    plain = Pipeline.from_pretrained(checkpoint, **kw)  # default: greedy's variant only
    assert plain.stats()["decode"]["captures"] == 3
    assert not any(key[1].ban for key in plain.runner.decoder.cache.live_keys())
    FakeGraph.log = []
