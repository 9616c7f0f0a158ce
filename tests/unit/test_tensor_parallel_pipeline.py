"""`Pipeline.from_pretrained(..., tensor_parallel_size=N)` on the CPU: rank 0 in this process, the
other ranks in spawned worker processes over gloo, each holding its shard of the language model.
In float32 the sharded Pipeline gives the unsharded one's tokens (images, several requests at
once, prompts chunked across steps, seeded sampling with a repetition penalty, a request
aborted mid-decode, a KV cache small enough to preempt); its workers stop with `close()`; a
worker that dies is reported by name, not waited on forever."""

from __future__ import annotations

import os

import pytest
import torch

from mmpipe import EngineError, InputError, Pipeline, SamplingParams
from mmpipe.errors import UnsupportedModelError
from tests.helpers import random_image

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned ranks on a 2-core machine

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def conversations() -> list:
    images = [random_image(120, 90, seed=1), random_image(64, 200, seed=2), random_image(150, 150, seed=3)]
    texts = ["Describe this image.", "compare the two pictures", "Tell me a story about a fox."]
    convs = [[{"role": "user", "content": [{"type": "image", "image": images[i]}, {"type": "text", "text": t}]}]
             for i, t in enumerate(texts)]
    convs.append([{"role": "user", "content": [{"type": "image", "image": images[0]},
                                               {"type": "image", "image": images[1]},
                                               {"type": "text", "text": texts[1]}]}])
    convs.append([{"role": "user", "content": "a small green triangle at the bottom"}])
    return convs


@pytest.fixture(scope="module")
def tp_checkpoint(checkpoint_factory):
    """Tiny Qwen2.5-VL with 4 query heads and 2 KV heads: one KV head per rank at 2 ranks, and a
    vocabulary that 2 ranks do not divide evenly."""
    return checkpoint_factory()


def run(path: str, size: int, sampling: SamplingParams | list[SamplingParams] = GREEDY, **options) -> list:
    pipe = Pipeline.from_pretrained(path, device="cpu", dtype="float32", tensor_parallel_size=size, **options)
    try:
        return [o.token_ids for o in pipe.chat(conversations(), sampling, progress=False)], pipe.stats()
    finally:
        pipe.close()


@pytest.fixture(scope="module")
def one_kv_head(checkpoint_factory):
    """One KV head: each of 2 ranks holds a copy of it (replicated), in the paged cache too."""
    return checkpoint_factory(text={"num_key_value_heads": 1})


@pytest.mark.parametrize("vit_parallel, kv", [("data", 2), ("rank0", 2), ("tensor", 2), ("data", 1)])
def test_two_ranks_give_the_unsharded_tokens(tp_checkpoint, one_kv_head, vit_parallel, kv):
    path = tp_checkpoint if kv == 2 else one_kv_head
    reference, _ = run(path, 1)
    ours, stats = run(path, 2, vit_parallel=vit_parallel)
    assert ours == reference
    assert len({tuple(t) for t in reference}) > 2  # the prompts give different answers
    assert stats["tensor_parallel"]["size"] == 2 and stats["tensor_parallel"]["vit_parallel"] == vit_parallel
    assert stats["tensor_parallel"]["vision_sharded"] == (vit_parallel == "tensor")
    on_workers = stats["tensor_parallel"]["images_encoded_by_workers"]
    assert (on_workers > 0) if vit_parallel == "data" else on_workers == 0
    assert stats["runner"]["images_encoded"] + on_workers == 3  # each distinct image once
    # The worker's ViT calls, as it reported them: every pack of rank 0 (tensor), its shares (data).
    worker = stats["tensor_parallel"]["worker_vit_runs"].get(1, {"graph_runs": 0, "eager_runs": 0})
    ours_runs = stats["vit"]["graph_runs"] + stats["vit"]["eager_runs"]
    theirs = worker["graph_runs"] + worker["eager_runs"]
    assert theirs == ours_runs if vit_parallel == "tensor" else (theirs > 0) == (vit_parallel == "data")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_split_the_experts_and_give_the_unsharded_tokens(checkpoint_factory, expert_parallel):
    """Qwen3-VL-MoE: each rank holds half of every expert's width (the router whole), or with
    expert parallelism half of the experts whole; the layer's output is summed over the ranks;
    the dense layer between sparse ones splits as usual."""
    path = checkpoint_factory(family="qwen3_vl_moe")
    reference, _ = run(path, 1)
    ours, stats = run(path, 2, expert_parallel=expert_parallel)
    assert ours == reference and len({tuple(t) for t in reference}) > 2
    assert stats["tensor_parallel"]["size"] == 2


def test_expert_parallelism_is_refused_where_it_cannot_split(checkpoint_factory):
    with pytest.raises(InputError, match="give tensor_parallel_size > 1"):
        Pipeline.from_pretrained(checkpoint_factory(family="qwen3_vl_moe"), device="cpu", expert_parallel=True)
    with pytest.raises(UnsupportedModelError, match="the model has no mixture-of-experts layers"):
        Pipeline.from_pretrained(checkpoint_factory(), device="cpu", tensor_parallel_size=2, expert_parallel=True)
    with pytest.raises(UnsupportedModelError, match="does not divide its 8 experts"):
        Pipeline.from_pretrained(checkpoint_factory(family="qwen3_vl_moe", text={"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48}), device="cpu",
                                 tensor_parallel_size=3, expert_parallel=True)


@pytest.fixture(scope="module")
def kv_pairs(checkpoint_factory):
    """8 query heads and 2 KV heads: at 4 ranks each KV head is replicated on the two ranks whose
    query heads attend with it (in the paged cache too)."""
    return checkpoint_factory(text={"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2})


def test_four_ranks_sharing_two_kv_heads_give_the_unsharded_tokens(kv_pairs):
    reference, _ = run(kv_pairs, 1)
    ours, stats = run(kv_pairs, 4)
    assert ours == reference and len({tuple(t) for t in reference}) > 2
    assert stats["tensor_parallel"]["size"] == 4


def test_shares_split_a_steps_images_by_patches():
    from mmpipe.engine.tensor_parallel import split_shares

    assert split_shares([10] * 8, 2) == [(0, 4), (4, 8)]
    assert split_shares([5, 100, 5], 2) == [(0, 2), (2, 3)]  # the big image's middle lies in the first half
    assert split_shares([10] * 7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert split_shares([10, 10], 4) == [(0, 1), (1, 1), (1, 2), (2, 2)]  # empty shares
    for patches in ([3, 1, 4, 1, 5, 9, 2, 6], [7], []):
        shares = split_shares(patches, 3)
        assert shares[0][0] == 0 and shares[-1][1] == len(patches)
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(shares, shares[1:]))


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prompts_sampling_and_a_small_kv_cache_match_too(tp_checkpoint, overlap):
    """Prompts split over several prefill steps, few KV pages (requests wait and are preempted),
    seeded sampling with a repetition penalty (the workers' sampler rows carry the penalty's
    history and the seeds); with overlapped scheduling too (CUDA's default: a step is launched
    before the previous one's tokens are read, so rows carry a token in flight)."""
    sampled = [SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7 + i, repetition_penalty=1.3,
                              ignore_eos=True) for i in range(len(conversations()))]
    options = dict(max_prefill_tokens=48, num_kv_pages=40, kv_page_size=4)
    reference, _ = run(tp_checkpoint, 1, sampled, **options)
    ours, stats = run(tp_checkpoint, 2, sampled, overlap_schedule=overlap, **options)
    assert ours == reference and stats["overlap_schedule"] is overlap
    assert stats["requests"]["preemptions"] > 0 and stats["runner"]["prefill_forwards"] > len(sampled)


def test_abort_mid_decode_and_close_leave_no_worker(tp_checkpoint):
    pipe = Pipeline.from_pretrained(tp_checkpoint, device="cpu", dtype="float32", tensor_parallel_size=2)
    workers = list(pipe.runner.workers.processes)
    assert workers and all(w.is_alive() for w in workers)
    stream = pipe.stream(conversations()[0], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    first = [next(stream) for _ in range(3)]
    stream.close()  # aborts the request: its rows leave every rank's decode batch
    again = pipe.chat(conversations()[:2], GREEDY, progress=False)
    single = Pipeline.from_pretrained(tp_checkpoint, device="cpu", dtype="float32")
    try:
        assert [o.token_ids for o in again] == [o.token_ids for o in single.chat(conversations()[:2], GREEDY,
                                                                                  progress=False)]
    finally:
        single.close()
    assert len(first) == 3
    pipe.close()
    assert not any(w.is_alive() for w in workers) and not any(_alive(w.pid) for w in workers)


def test_a_worker_that_dies_is_reported_not_waited_on(tp_checkpoint):
    pipe = Pipeline.from_pretrained(tp_checkpoint, device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        worker = pipe.runner.workers.processes[0]
        worker.kill()
        worker.join(10)
        import time

        time.sleep(1.5)  # rank 0's watch notices without any call (and aborts a waiting collective)
        assert "rank 1 exited" in (pipe.runner.workers.failure or "")
        with pytest.raises(EngineError, match="tensor-parallel rank 1 exited"):
            pipe.chat(conversations()[0], GREEDY, errors="raise")
    finally:
        pipe.close()


def test_settings_it_cannot_serve_are_refused_by_name(tp_checkpoint, monkeypatch):
    from mmpipe.config import EngineConfig
    from mmpipe.engine.tensor_parallel import check_tensor_parallel

    with pytest.raises(InputError, match="tensor_parallel_size=0"):
        Pipeline.from_pretrained(tp_checkpoint, device="cpu", tensor_parallel_size=0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InputError, match="tensor_parallel_size=2 from cuda:0: needs GPUs 0..1, this machine has 1"):
        check_tensor_parallel(2, torch.device("cuda", 0), EngineConfig())


def test_a_split_the_heads_do_not_allow_is_refused_before_any_worker_starts(tp_checkpoint, checkpoint_factory,
                                                                           monkeypatch):
    """4 query heads over 3 ranks, or a one-head vision tower split over 2 (`vit_parallel="tensor"`):
    one line naming the heads, and no worker process started (a worker would print its own
    traceback of the same error)."""
    from mmpipe.engine.tensor_parallel import Workers

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(Workers, "__init__", no_workers)
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=3 does not divide 4 attention heads"):
        Pipeline.from_pretrained(tp_checkpoint, device="cpu", tensor_parallel_size=3)
    one_head_tower = checkpoint_factory(vision={"num_heads": 1})
    with pytest.raises(UnsupportedModelError, match="does not divide the vision tower's 1 attention heads"):
        Pipeline.from_pretrained(one_head_tower, device="cpu", tensor_parallel_size=2, vit_parallel="tensor")


def test_the_bundled_model_captions_the_same_on_two_ranks():
    """The trained bundled model (485-token vocabulary: 243 rows on rank 0, 242 and a zero row on
    rank 1) captions the sample images exactly as unsharded."""
    from mmpipe.pipeline import default_model_path

    images = sorted(os.path.join("assets/images", f) for f in os.listdir("assets/images") if f.endswith(".png"))
    captions = []
    for size in (1, 2):
        pipe = Pipeline.from_pretrained(default_model_path(), device="cpu", dtype="float32", tensor_parallel_size=size)
        try:
            captions.append(pipe.caption(images, progress=False))
        finally:
            pipe.close()
    assert captions[0] == captions[1] and all(captions[0])


_CHILD = """
import os, sys, time
sys.path.insert(0, {root!r})
from mmpipe import Pipeline, SamplingParams
pipe = Pipeline.from_pretrained({path!r}, device="cpu", dtype="float32", tensor_parallel_size=2)
print(" ".join(str(p.pid) for p in pipe.runner.workers.processes), flush=True)
while True:  # busy until signalled
    pipe.generate(["a small green triangle"], sampling=SamplingParams(max_new_tokens=64, ignore_eos=True))
"""


@pytest.mark.parametrize("how", ["ctrl-c", "kill"])
def test_no_worker_outlives_its_pipeline_process(tp_checkpoint, tmp_path, how):
    """Ctrl-C (SIGINT) or SIGKILL of the process holding rank 0, mid-generation: its worker
    processes end too (no orphans holding GPU memory)."""
    import signal
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=root, path=tp_checkpoint))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in child.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
        time.sleep(1.0)  # inside a generation
        child.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        child.wait(60)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        if child.poll() is None:
            child.kill()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _Image:
    def __init__(self, tokens: int, patches: int) -> None:
        self.num_tokens, self.num_patches = tokens, patches


class _Pipe:
    def __init__(self, incoming: list) -> None:
        self.incoming, self.sent = list(incoming), []

    def recv(self):
        return self.incoming.pop(0)

    def send(self, message) -> None:
        self.sent.append(message)


@pytest.mark.parametrize("failure", [None, "input", "memory"])
def test_a_workers_share_of_the_images_always_answers(failure):
    """A worker's share that fails to encode still sends one tensor per image (rank 0's receives
    complete) and says why; one that succeeds sends its embeddings and says so."""
    from types import SimpleNamespace

    from mmpipe.engine.tensor_parallel.worker import _serve

    images = [_Image(3, 12), _Image(2, 8)]

    def encode(share):
        if failure == "input":
            raise InputError("image 'x.jpg': the GPU cannot decode it")
        if failure == "memory":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return [torch.full((im.num_tokens, 8), float(i + 1)) for i, im in enumerate(share)]

    runner = SimpleNamespace(_encode_packs=encode, model=SimpleNamespace(language=SimpleNamespace(hidden_size=8)),
                             dtype=torch.float32, device=torch.device("cpu"))
    sends = []
    group = SimpleNamespace(rank=1, send=lambda t, dst: sends.append((t.clone(), dst)))
    pipe = _Pipe([("encode", images), ("stop", None)])
    _serve(runner, group, pipe)
    assert [tuple(t.shape) for t, _ in sends] == [(3, 8), (2, 8)] and all(dst == 0 for _, dst in sends)
    if failure is None:
        assert pipe.sent == [("encoded", {"graph_runs": 0, "eager_runs": 0})] and sends[1][0].eq(2.0).all()
    else:
        kind, (what, message) = pipe.sent[0]
        assert kind == "encode_failed" and what == failure and all(t.eq(0).all() for t, _ in sends)
        assert ("x.jpg" in message) if failure == "input" else ("out of memory" in message)


@pytest.mark.parametrize("reply", [("encoded", None), ("encode_failed", ("input", "image 'x.jpg': bad")),
                                   ("encode_failed", ("memory", "rank 1: CUDA out of memory"))])
def test_rank_0_keeps_the_order_and_raises_a_failed_share_as_one_gpu_would(reply, monkeypatch):
    """Rank 0 gathers its share and the worker's in the images' order; a share the worker could not
    encode raises what one GPU raises (InputError, out of memory), so the engine encodes the images
    one by one."""
    from types import SimpleNamespace

    from mmpipe.config import EngineConfig
    from mmpipe.engine.model_runner import ModelRunner
    from mmpipe.engine.tensor_parallel import TensorParallelRunner

    monkeypatch.setattr(ModelRunner, "_encode_packs",
                        lambda self, share: [torch.full((im.num_tokens, 4), -1.0) for im in share])
    runner = object.__new__(TensorParallelRunner)
    sent = []
    runner.workers = SimpleNamespace(size=2, send_to=lambda rank, kind, payload: sent.append((rank, len(payload))),
                                     reply=lambda rank: reply)
    runner.cfg, runner.images_on_workers, runner.worker_vit_runs = EngineConfig(), 0, {}
    runner.dtype, runner.device = torch.float32, torch.device("cpu")
    received = iter([7.0, 8.0])
    runner.model = SimpleNamespace(language=SimpleNamespace(hidden_size=4),
                                   tp=SimpleNamespace(recv=lambda out, src: out.fill_(next(received))))
    images = [_Image(1, 10), _Image(2, 10), _Image(3, 10), _Image(4, 10)]
    if reply[0] == "encoded":
        out = runner._encode_packs(images)
        assert [t.shape[0] for t in out] == [1, 2, 3, 4] and [t[0, 0].item() for t in out] == [-1, -1, 7, 8]
        assert sent == [(1, 2)] and runner.images_on_workers == 2
    else:
        with pytest.raises(InputError if reply[1][0] == "input" else torch.OutOfMemoryError, match=reply[1][1]):
            runner._encode_packs(images)


def _rank0(monkeypatch, reply, own=None):
    """Rank 0's runner with fakes for its workers and group (4 images: 2 its own, 2 a worker's)."""
    from types import SimpleNamespace

    from mmpipe.config import EngineConfig
    from mmpipe.engine.model_runner import ModelRunner
    from mmpipe.engine.tensor_parallel import TensorParallelRunner

    def mine(self, share):
        if own is not None:
            raise own
        return [torch.full((im.num_tokens, 4), -1.0) for im in share]

    monkeypatch.setattr(ModelRunner, "_encode_packs", mine)
    runner = object.__new__(TensorParallelRunner)
    log = []
    runner.workers = SimpleNamespace(size=2, failure=None, send_to=lambda rank, kind, payload: log.append("sent"),
                                     reply=lambda rank: log.append("replied") or reply)
    runner.cfg, runner.images_on_workers, runner.worker_vit_runs = EngineConfig(), 0, {}
    runner.dtype, runner.device = torch.float32, torch.device("cpu")
    received = iter([7.0, 8.0])
    runner.model = SimpleNamespace(language=SimpleNamespace(hidden_size=4),
                                   tp=SimpleNamespace(recv=lambda out, src: log.append("received") or
                                                      out.fill_(next(received))))
    return runner, log, [_Image(1, 10), _Image(2, 10), _Image(3, 10), _Image(4, 10)]


def test_rank_0s_own_share_failing_still_takes_the_workers_answers(monkeypatch):
    """Rank 0's own share raising (a file the GPU cannot decode) first takes the worker's
    embeddings and answer, so nothing is left unmatched for the next call, then raises as one
    GPU would; the ranks stay in step (no failure recorded)."""
    runner, log, images = _rank0(monkeypatch, ("encoded", None), own=InputError("image 'y.jpg': bad"))
    with pytest.raises(InputError, match="y.jpg"):
        runner._encode_packs(images)
    assert log == ["sent", "received", "received", "replied"] and runner.workers.failure is None


def test_an_interruption_after_the_workers_were_sent_a_call_ends_the_group(monkeypatch):
    """Anything else that stops rank 0 between sending a call and making its own part of it leaves
    the ranks' collectives out of step: it is recorded, and every later call raises."""
    runner, log, images = _rank0(monkeypatch, ("encoded", None), own=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        runner._encode_packs(images)
    assert "out of step" in runner.workers.failure and "vision encode" in runner.workers.failure


def test_a_failed_capture_in_lockstep_raises_instead_of_running_eagerly(monkeypatch):
    """A rank whose capture fails would run that size eagerly, with other collectives than its
    peers: in lockstep (`GraphRunner.lockstep` sets the cache strict) it raises instead."""
    from types import SimpleNamespace

    from mmpipe.graphs import cache as cache_module

    def failing_capture(body, memory, device, warmups=1, shared=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cache_module, "capture", failing_capture)
    body = lambda: None  # noqa: E731
    for strict in (False, True):
        cache = cache_module.GraphCache("decode", torch.device("cpu"), SimpleNamespace())
        cache.strict = strict
        if strict:
            with pytest.raises(RuntimeError, match="failed in lockstep"):
                cache.capture(1, body, "batch 1")
        else:
            assert cache.capture(1, body, "batch 1") is None and 1 in cache.failed


def test_two_ranks_with_grammars_and_output_penalties_give_the_unsharded_tokens(tp_checkpoint):
    """Every rank samples the constrained step over the same logits with the masks rank 0 sends;
    a rank without them would feed other tokens and its K/V shard would drift."""
    array = {"type": "array", "items": {"type": "integer"}}
    params = [SamplingParams(max_new_tokens=14, temperature=0.0, json_schema=array),
              SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.0),
              SamplingParams(max_new_tokens=14, temperature=0.9, seed=4, json_schema={"type": "object"}),
              SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=14, temperature=0.0, json_schema=array, presence_penalty=0.5)]
    reference, _ = run(tp_checkpoint, 1, params)
    ours, _ = run(tp_checkpoint, 2, params)
    assert ours == reference
