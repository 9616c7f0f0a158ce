"""The piecewise prefill runner on the CPU: the schedule and bisection, the split of the traced
forward (one attention split point per layer, the expected pieces), the split and compiled forward
equal to the plain one, padding that touches nothing, and (with CUDA graphs simulated: a replay
runs the piece again and writes the tensors its capture returned) the whole engine giving the same
tokens with piecewise graphs on and off."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from mmpipe.language.attention.op import attention
from mmpipe.language.kv_cache import KVCache
from mmpipe.language.prefill_graphs import PrefillRunner
from mmpipe.language.prefill_schedule import STARTUP_PREFILL_SIZES, default_prefill_schedule, fine_prefill_schedule

from mmpipe import GraphConfig, GraphMode, Pipeline, SamplingParams
from mmpipe.graphs import cache as graph_cache_module
from mmpipe.graphs import piecewise as piecewise_module
from mmpipe.graphs import runner as graph_runner_module
from mmpipe.graphs import split_capture as split_capture_module
from mmpipe.graphs.cache import bucket_for
from tests.helpers import random_image, stacked_kv
from tests.lm_helpers import CPU, LAYERS, extend_meta, make_runner, run, tiny_lm  # noqa: F401
from tests.split_tape import TapeRecorder


def test_default_schedule_covers_every_step_up_to_the_budget():
    """Every prefill step the scheduler can form (at most max_prefill_tokens, up to 8192) has a
    graph: the start-up sizes to 2048, then every 512 tokens, the budget itself last."""
    sizes = default_prefill_schedule(8192)
    assert sizes[:len(STARTUP_PREFILL_SIZES)] == list(STARTUP_PREFILL_SIZES)
    assert sizes[len(STARTUP_PREFILL_SIZES):] == list(range(2560, 8193, 512)) and len(sizes) == 32
    assert len(sizes) == len(set(sizes)) and sizes == sorted(sizes)
    # Padding above 256 tokens costs at most a quarter of a step.
    assert all(b <= a * 1.25 for a, b in zip(sizes, sizes[1:]) if a >= 256)
    assert default_prefill_schedule(100) == [8, 16, 32, 64, 96, 100]
    assert default_prefill_schedule(3) == [3]
    assert default_prefill_schedule(2048) == list(STARTUP_PREFILL_SIZES)
    assert default_prefill_schedule(4000)[-4:] == [2560, 3072, 3584, 4000]
    assert default_prefill_schedule(2600)[-3:] == [2048, 2560, 2600]
    # A larger budget captures what 8192 does; its longer steps run without graphs.
    assert default_prefill_schedule(32768) == sizes and default_prefill_schedule(8500) == sizes
    assert default_prefill_schedule(2300)[-2:] == [2048, 2300]
    # A runner given no sizes takes this schedule for its budget.
    assert make_runner(tiny_lm(), True, max_tokens=3000).schedule == default_prefill_schedule(3000)
    assert make_runner(tiny_lm(), True, max_tokens=9000).schedule[-1] == 8192
    assert [bucket_for(sizes, n) for n in (1, 8, 9, 257, 1025, 2048, 2049, 4097, 8192, 8193)] == [
        8, 8, 16, 320, 1280, 2048, 2560, 4608, 8192, None]


def test_fine_schedule_follows_the_source_notes_and_is_capped():
    sizes = fine_prefill_schedule(8192)
    assert sizes[:9] == [4, 8, 12, 16, 20, 24, 28, 32, 48]
    assert sizes[sizes.index(256) + 1] == 288 and sizes[sizes.index(512) + 1] == 576
    assert sizes[sizes.index(1024) + 1] == 1280 and sizes[sizes.index(4096) + 1] == 4608
    assert sizes[-2:] == [7680, 8192] and len(sizes) == len(set(sizes)) == sorted(sizes).__len__()
    steps = {b - a for a, b in zip(sizes, sizes[1:])}
    assert steps == {4, 16, 32, 64, 256, 512}
    assert fine_prefill_schedule(100) == [4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96, 100]
    assert fine_prefill_schedule(3) == [3]


def test_the_traced_forward_splits_at_attention_once_per_layer():
    lm = tiny_lm()
    runner = make_runner(lm, piecewise=True, traced=True)
    run(runner, [(0, 10)], seed=1)
    backend = runner.backend
    assert backend is not None and backend.stats.graphs_seen == 1
    items = backend.items
    splits = [item for item in items if item.is_split]
    pieces = [item for item in items if not item.is_split]
    assert len(splits) == LAYERS and len(pieces) == LAYERS + 1
    assert [item.is_split for item in items] == [False, True] * LAYERS + [False]  # alternating, in order

    def calls(module, target):
        return sum(1 for n in module.graph.nodes if n.op == "call_function" and n.target is target)

    for item in splits:  # the split point calls the attention function directly (not the custom op)
        assert calls(item.module, attention) == 1 and len(list(item.module.graph.nodes)) == 7  # 5 inputs, call, out
        assert calls(item.module, torch.ops.mmpipe.lm_attention.default) == 0
    linear = torch._C._nn.linear
    # piece 0: rotary tables, first norm, qkv, rotary + KV write; middle: o, gate_up, down, next qkv,
    # rotary + KV write; last: o, gate_up, down
    assert [calls(p.module, linear) for p in pieces] == [1] + [4] * (LAYERS - 1) + [3]
    rope = torch.ops.mmpipe.rope_kv_write  # dynamo records the op packet
    assert [calls(p.module, rope) for p in pieces] == [1] * LAYERS + [0]
    layer_of_split = [next(n.args[4] for n in s.module.graph.nodes if n.target is attention) for s in splits]
    assert layer_of_split == list(range(LAYERS))
    stats = runner.stats()["detail"]
    assert stats["pieces"] == LAYERS + 1 and stats["split_points"] == LAYERS and stats["compiled"]


@pytest.mark.parametrize("lengths", [[(0, 10)], [(0, 3), (5, 4), (0, 1)], [(0, 64)], [(6, 7), (0, 9)]])
def test_the_split_compiled_forward_equals_the_plain_forward(lengths):
    """Float32, random weights: hidden states and every byte of the KV cache are equal, for one
    and several sequences, with and without a cached prefix, on and between schedule sizes."""
    lm = tiny_lm()
    plain, split = make_runner(lm, piecewise=False), make_runner(lm, piecewise=True)
    for runner in (plain, split):  # a cached prefix where the lengths say so
        prefix = [(0, c) for c, _ in lengths if c]
        if prefix:
            runner.forward(torch.arange(sum(c for _, c in prefix)) % 97,
                           torch.arange(sum(c for _, c in prefix)).unsqueeze(1).expand(-1, 3), [],
                           extend_meta([(0, c) if c else (0, 0) for c, _ in lengths if c], 8))
    a, b = run(plain, lengths, seed=3), run(split, lengths, seed=3)
    if split.padded_tokens == 0 and split.rows_for(a.shape[0]) == a.shape[0] and \
            split.rows_for(sum(c for c, _ in lengths)) == sum(c for c, _ in lengths):
        assert torch.equal(a, b)
        assert torch.equal(stacked_kv(plain.kv), stacked_kv(split.kv))
    else:  # padded rows change the matmul blocking (rounding only) and write the dummy page
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stacked_kv(split.kv)[:, :, 1:], stacked_kv(plain.kv)[:, :, 1:], rtol=1e-5, atol=1e-5)
    assert split.compiled_runs >= 1 and plain.counts.eager_runs >= 1


# ---------------------------------------------------------------------------- simulated graphs

class ReplayingPiece:
    """Stands in for a piece's CUDA graph on the CPU: a replay runs the captured body again (on
    the tensors it captured) and writes the results into the tensors the capture returned."""

    captured: list = []

    def __init__(self, body, output):
        self.body, self.output = body, output
        ReplayingPiece.captured.append(self)

    def replay(self):
        fresh = self.body()
        outs = self.output if isinstance(self.output, (tuple, list)) else (self.output,)
        news = fresh if isinstance(fresh, (tuple, list)) else (fresh,)
        for out, new in zip(outs, news):
            if isinstance(out, torch.Tensor):
                out.copy_(new)

    def reset(self):
        pass


class NoMemory:
    name = "fake"

    def open(self):
        return object()

    def release(self, memory):
        pass

    def physical_bytes(self):
        return None

    def capturing(self, memory):
        return contextlib.nullcontext()

    def close(self):
        pass


@pytest.fixture
def simulated_piece_graphs(monkeypatch, switch):
    from mmpipe.engine import model_runner

    def fake_capture(body, memory, device, warmups=1, shared=None):
        for _ in range(warmups):
            body()
        output = body()
        return ReplayingPiece(body, output), output, shared

    monkeypatch.setattr(graph_cache_module, "capture", fake_capture)
    monkeypatch.setattr(split_capture_module, "CudaRecorder", TapeRecorder)
    monkeypatch.setattr(piecewise_module, "weak_refs", lambda outputs: outputs)  # CPU memory is not pooled
    monkeypatch.setattr(graph_runner_module, "can_capture_on", lambda device: True)
    monkeypatch.setattr(model_runner, "effective_graph_mode",
                        lambda mode, device: GraphMode.PIECEWISE if mode is None else GraphMode(mode))
    monkeypatch.setattr(model_runner, "SharedPool", NoMemory)
    switch("MMPIPE_CHECK_GRAPH_INPUTS", "1")  # replays must see their capture's addresses
    from mmpipe.language.attention.torch_backend import TorchLMAttention
    monkeypatch.setattr(TorchLMAttention, "graph_safe", True)
    ReplayingPiece.captured = []


@pytest.mark.parametrize("traced", [False, True], ids=["split", "traced"])
def test_simulated_piece_graphs_replay_padded_sizes_like_the_plain_forward(simulated_piece_graphs, traced):
    """Both piecewise paths: pieces captured from the eager forward (default) and pieces of the
    traced FX graph (the inductor compiler's path)."""
    lm = tiny_lm()
    schedule = (8, 16, 32)
    plain = make_runner(lm, piecewise=False)
    # The same padded sizes without graphs: traced pieces (eager pieces without graphs do not pad).
    compiled = PrefillRunner(lm, KVCache(LAYERS, 24, 8, lm.num_kv_heads, lm.head_dim, torch.float32, CPU), CPU,
                             64, True, GraphConfig(buckets=schedule, enabled=False), traced=True)
    graphs = PrefillRunner(lm, KVCache(LAYERS, 24, 8, lm.num_kv_heads, lm.head_dim, torch.float32, CPU), CPU, 64,
                           True, GraphConfig(buckets=schedule), memory=NoMemory(), traced=traced)
    graphs.capture_all(progress=False)
    assert graphs.cache is not None and len(graphs.cache.graphs) == len(schedule) * (LAYERS + 1)
    assert graphs.stats()["detail"]["traced"] is traced and graphs.stats()["detail"]["pieces"] == LAYERS + 1
    page = 1
    # Each step on pages of its own, so a padded row writing a stale slot of an earlier, larger
    # step (here 2 tokens padded to 8 after 40) would show in that step's pages.
    for seed, lengths in enumerate([[(0, 5)], [(0, 8)], [(0, 3), (0, 10)], [(0, 40)], [(0, 2)], [(0, 16)]]):
        a, b, c = (run(r, lengths, seed, page) for r in (plain, graphs, compiled))
        page += len(lengths) * max(-(-n // 8) for _, n in lengths)
        assert torch.equal(b, c), lengths  # the same padded size without graphs: exactly equal
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # the plain forward: rounding only
    real = slice(1, None)  # pages after the dummy page (padded rows and the captures write there)
    assert torch.equal(stacked_kv(compiled.kv)[:, :, real], stacked_kv(graphs.kv)[:, :, real])  # padding wrote nothing
    torch.testing.assert_close(stacked_kv(graphs.kv)[:, :, real], stacked_kv(plain.kv)[:, :, real], rtol=1e-5, atol=1e-5)
    stats = graphs.stats()
    assert stats["graph_runs"] == 5 and stats["detail"]["compiled_runs"] == 1  # 40 tokens: above 32
    assert stats["detail"]["padded_tokens"] == (8 - 5) + 0 + (16 - 13) + (8 - 2) + 0
    assert stats["replays"] == 5 * (LAYERS + 1) and stats["captures"] == len(schedule) * (LAYERS + 1)
    if traced:
        # The first forward at a size records its replay plan; later ones (8 and 2 tokens at 8, 16
        # at 16) were checked against it (input checks are on here: the compiled path runs and
        # must make the plan's calls exactly).
        assert sorted(size for _, size in graphs.state.plans) == [8, 16] and stats["detail"]["replay_plans"] == 2
        assert stats["detail"]["plan_runs"] == 3
    else:  # every size's plan is made by its capture, and serves every run at that size
        assert sorted(graphs.split.plans) == [8, 16, 32] and stats["detail"]["plan_runs"] == 5
    # The plans themselves (no input checks), equal to the same size without graphs.
    graphs.state.check_inputs = False
    for seed, lengths in enumerate([[(0, 6)], [(0, 4), (0, 9)]], start=10):
        assert torch.equal(run(graphs, lengths, seed, page), run(compiled, lengths, seed, page)), lengths
        page += len(lengths) * 2
    assert graphs.stats()["detail"]["plan_runs"] == stats["detail"]["plan_runs"] + 2


def test_split_capture_holds_the_split_points_and_output_of_the_pieces(simulated_piece_graphs):
    """Pieces captured from the eager forward: one attention split point per layer, in layer
    order, each reading the tensors of the piece before it; a size's plan alternates pieces and
    split points and returns the last piece's output."""
    from mmpipe.language.attention.op import attend

    lm = tiny_lm()
    graphs = captured_split_runner(lm, (8, 16))
    assert graphs.backend is None and graphs.compiled is None  # nothing traced
    for size in (8, 16):
        steps = graphs.split.plans[size].steps
        assert len(steps) == 2 * LAYERS + 1
        assert [fn is attend for fn, _ in steps] == [False, True] * LAYERS + [False]
        assert [args[4] for fn, args in steps if fn is attend] == list(range(LAYERS))
        for fn, args in steps:
            if fn is attend:  # q, out [size, heads, dim]; k, v [size, kv heads, dim]
                assert [a.shape[0] for a in args[:4]] == [size] * 4
        pieces = [args[0] for fn, args in steps if fn is not attend]
        assert [graphs.cache.graphs[(size, i)] for i in range(LAYERS + 1)] == pieces
    assert graphs.startup_note().startswith(f" x {LAYERS + 1} pieces")


def captured_split_runner(lm, schedule, lockstep: bool = False) -> PrefillRunner:
    """A runner whose pieces are captured from the eager forward, every schedule size captured."""
    graphs = PrefillRunner(lm, KVCache(LAYERS, 24, 8, lm.num_kv_heads, lm.head_dim, torch.float32, CPU), CPU, 64,
                           True, GraphConfig(buckets=schedule), memory=NoMemory())
    graphs.lockstep = lockstep
    graphs.capture_all(progress=False)
    return graphs


def test_capture_runs_largest_first_and_a_failed_size_runs_compiled(simulated_piece_graphs, monkeypatch):
    """A piece that cannot be captured (the second piece of size 16) fails its whole size, which
    then runs without graphs; its pieces captured before the failure are destroyed."""
    lm = tiny_lm()
    order = []  # the size of every piece capture begun
    real_begin, real_dummy = TapeRecorder.begin, PrefillRunner._dummy_forward
    current = [None, 0]  # the size being captured, pieces begun in this capture

    def dummy_forward(self, size, capture, graphs=True, last_try=True):
        current[:] = [size, 0]
        return real_dummy(self, size, capture, graphs, last_try)

    def begin(self, memory):
        order.append(current[0])
        current[1] += 1
        if current[0] == 16 and current[1] == 2:  # the second piece of size 16
            raise torch.cuda.OutOfMemoryError("simulated")
        return real_begin(self, memory)

    monkeypatch.setattr(TapeRecorder, "begin", begin)
    monkeypatch.setattr(PrefillRunner, "_dummy_forward", dummy_forward)
    graphs = captured_split_runner(lm, (8, 16, 32))
    sizes_in_order = [s for i, s in enumerate(order) if i == 0 or order[i - 1] != s]
    assert sizes_in_order == [32, 16, 8]
    assert graphs.failed_sizes() == [16] and graphs.stats()["detail"]["failed_sizes"] == [16]
    # Without a warm-up it failed at piece 1 (piece 0 discarded), then again after one: one failure.
    assert order.count(16) == 4
    assert graphs.stats()["capture_failures"] == 1 and graphs.stats()["detail"]["warmup_retries"] == 1
    assert not any(key[0] == 16 for key in graphs.cache.graphs)  # piece 0 of size 16 destroyed
    assert len(graphs.cache.graphs) == 2 * (LAYERS + 1)
    plain = make_runner(lm, piecewise=False)
    assert torch.equal(run(plain, [(0, 12)], 4), run(graphs, [(0, 12)], 4))  # 12 -> 16: failed, no graphs
    assert graphs.compiled_runs == 1 and graphs.counts.graph_runs == 0


def test_split_capture_warms_up_once_and_again_only_for_a_size_that_failed(simulated_piece_graphs, monkeypatch):
    """Start-up runs one eager warm-up forward (at the largest size); the other sizes are captured
    straight away. A size whose capture fails without a warm-up (here 16, once) is warmed up and
    captured again: it gets its graphs, equal to the plain forward, and is not marked failed."""
    lm = tiny_lm()
    warmups, failures = [], []
    real_dummy, real_begin = PrefillRunner._dummy_forward, TapeRecorder.begin
    current = [None]

    def dummy_forward(self, size, capture, graphs=True, last_try=True):
        current[0] = size
        if not capture:
            warmups.append(size)
        return real_dummy(self, size, capture, graphs, last_try)

    def begin(self, memory):
        if current[0] == 16 and not failures:
            failures.append(16)
            raise RuntimeError("simulated: a kernel first loaded inside the capture")
        return real_begin(self, memory)

    monkeypatch.setattr(PrefillRunner, "_dummy_forward", dummy_forward)
    monkeypatch.setattr(TapeRecorder, "begin", begin)
    graphs = captured_split_runner(lm, (8, 16, 32))
    assert failures == [16] and warmups == [32, 16]
    assert graphs.failed_sizes() == [] and graphs.stats()["capture_failures"] == 0
    assert graphs.stats()["detail"]["warmup_retries"] == 1
    assert sorted(graphs.split.plans) == [8, 16, 32] and len(graphs.cache.graphs) == 3 * (LAYERS + 1)
    plain = make_runner(lm, piecewise=False)
    for seed, n in enumerate((5, 12, 30)):
        torch.testing.assert_close(run(graphs, [(0, n)], seed), run(plain, [(0, n)], seed),
                                   rtol=1e-5, atol=1e-5)
    assert graphs.counts.graph_runs == 3


def test_in_lockstep_every_size_warms_up(simulated_piece_graphs, monkeypatch):
    """Tensor parallelism: no capture without a warm-up (a rank's retry would run collectives the
    other ranks do not)."""
    warmups = []
    real_dummy = PrefillRunner._dummy_forward

    def dummy_forward(self, size, capture, graphs=True, last_try=True):
        if not capture:
            warmups.append(size)
        assert last_try, "a capture that may fail quietly in lockstep"
        return real_dummy(self, size, capture, graphs, last_try)

    monkeypatch.setattr(PrefillRunner, "_dummy_forward", dummy_forward)
    graphs = captured_split_runner(tiny_lm(), (8, 16, 32), lockstep=True)
    assert warmups == [32, 16, 8] and sorted(graphs.split.plans) == [8, 16, 32]


def test_traced_capture_runs_largest_first_and_a_failed_size_runs_compiled(simulated_piece_graphs, monkeypatch):
    lm = tiny_lm()
    order = []
    real = graph_cache_module.capture

    def capture(body, memory, device, warmups=1, shared=None):
        order.append(graphs.state.size)
        if graphs.state.size == 16 and len(order) > 1 and order[-2] == 16:  # the second piece of size 16
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(body, memory, device, warmups, shared)

    monkeypatch.setattr(graph_cache_module, "capture", capture)
    graphs = PrefillRunner(lm, KVCache(LAYERS, 24, 8, lm.num_kv_heads, lm.head_dim, torch.float32, CPU), CPU, 64,
                           True, GraphConfig(buckets=(8, 16, 32)), memory=NoMemory(), traced=True)
    graphs.capture_all(progress=False)
    sizes_in_order = [s for i, s in enumerate(order) if i == 0 or order[i - 1] != s]
    assert sizes_in_order == [32, 16, 8]
    assert graphs.failed_sizes() == [16] and graphs.stats()["detail"]["failed_sizes"] == [16]
    plain = make_runner(lm, piecewise=False)
    assert torch.equal(run(plain, [(0, 12)], 4), run(graphs, [(0, 12)], 4))  # 12 -> 16: failed, compiled
    assert graphs.compiled_runs == 1 and graphs.counts.graph_runs == 0


def test_engine_tokens_equal_with_piecewise_graphs_on_and_off(checkpoint, simulated_piece_graphs):
    """Prompts with and without images, chunked prefill (a small token budget) mixed with decode:
    greedy tokens identical; the piecewise pipeline really replays graphs."""
    kw = dict(device="cpu", max_prefill_tokens=48, max_running_requests=4)
    graphs = Pipeline.from_pretrained(checkpoint, prefill_graph=GraphConfig(buckets=(8, 16, 32, 48)), **kw)
    eager = Pipeline.from_pretrained(checkpoint, prefill_graph=GraphConfig(enabled=False), graph_mode="none", **kw)
    assert graphs.stats()["prefill"]["graphs"] > 0
    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": random_image(60 + 20 * i, 50, seed=i)},
                                      {"type": "text", "text": "what is in the picture?"}]}] for i in range(3)
    ] + [[{"role": "user", "content": "count to five " * 6}]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0)
    ours = graphs.chat(conversations, params)
    reference = eager.chat(conversations, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    stats = graphs.stats()["prefill"]
    assert stats["graph_runs"] > 0 and stats["replays"] > 0
    assert eager.stats()["prefill"]["graphs"] == 0 and eager.stats()["prefill"]["eager_runs"] > 0
    graphs.close()
    eager.close()


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="Inductor on the CPU needs a C++ compiler")
def test_inductor_pieces_compile_once_per_distinct_piece_and_load_from_the_cache(tmp_path):
    """Cold: the middle layers' pieces are one compilation; warm: everything loads, nothing
    compiles, the same numbers come out."""
    lm = tiny_lm()
    plain = make_runner(lm, piecewise=False)
    expected = run(plain, [(0, 16)], 2)
    counts = []
    for _ in range(2):
        kv = KVCache(LAYERS, 24, 8, lm.num_kv_heads, lm.head_dim, torch.float32, CPU)
        runner = PrefillRunner(lm, kv, CPU, 64, True, None, compiler="inductor", cache_dir=tmp_path)
        torch.testing.assert_close(run(runner, [(0, 16)], 2), expected, rtol=1e-5, atol=1e-5)
        stats = runner.stats()["detail"]
        counts.append((stats["compilations"], stats["compile_cache_loads"]))
    assert counts == [(3, 0), (0, 3)]  # first piece, the middle layers' piece, the last piece


def test_a_replay_plan_is_made_only_from_piece_outputs_and_constants():
    """The recording refuses a plan whenever a later forward could differ: a split point reading a
    tensor no piece returned (an input that changes per step), a split point returning something,
    a piece that ran without its graph, an output that is not a piece's."""
    from types import SimpleNamespace

    from mmpipe.graphs.replay_plan import Recording

    a, b, fresh = torch.ones(2), torch.zeros(2), torch.ones(2)
    entry = SimpleNamespace(output=(a, b))
    replay_calls = []

    def recorded(split_args=(a, 3, b), result=(), output=b, piece_graphed=True):
        rec = Recording()
        rec.piece(replay_calls.append, entry)
        if not piece_graphed:
            rec.valid = False
        rec.split(lambda *args: None, split_args, result)
        return rec.finish(output)

    plan = recorded()
    assert plan is not None and plan.output is b
    assert plan.run() is b and replay_calls == [entry]

    def again(split_args=(a, 3, b)):
        rec = Recording()
        rec.piece(replay_calls.append, entry)
        rec.split(plan.steps[1][0], split_args, ())
        return rec

    assert plan.same_as(again(), b)  # what a checked forward compares
    assert not plan.same_as(again((a, 4, b)), b) and not plan.same_as(again((b, 3, a)), b)
    assert not plan.same_as(again(), a)
    assert recorded(split_args=(a, 3, fresh)) is None
    assert recorded(result=a) is None
    assert recorded(piece_graphed=False) is None
    assert recorded(output=fresh) is None


def test_eager_pieces_without_graphs_run_the_exact_size():
    """Padding to a schedule size pays only for graphs (or traced pieces compiled for it): without
    them the eager forward runs the step's own rows."""
    lm = tiny_lm()
    plain_pieces = make_runner(lm, piecewise=True, graphs=GraphConfig(buckets=(8, 16), enabled=False))
    traced = make_runner(lm, piecewise=True, graphs=GraphConfig(buckets=(8, 16), enabled=False), traced=True)
    assert plain_pieces.split is None and plain_pieces.rows_for(5) == 5
    assert traced.rows_for(5) == 8
    run(plain_pieces, [(0, 5)], seed=1)
    assert plain_pieces.padded_tokens == 0


def test_a_cache_closes_its_graph_memory_only_if_it_owns_it():
    """The row graphs borrow the prefill pieces' memory: closing them must leave it to its owner
    (an arena closed under live graphs would free their memory)."""
    from mmpipe.graphs.cache import GraphCache

    closed = []

    class Memory:
        def __init__(self, label):
            self.label = label

        def close(self):
            closed.append(self.label)

    GraphCache("borrowing", CPU, Memory("borrowed"), owns_memory=False).close()
    GraphCache("owning", CPU, Memory("owned")).close()
    assert closed == ["owned"]
