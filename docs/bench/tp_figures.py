"""Tensor parallelism on 2 GPUs: TP=1 against TP=2 on a random checkpoint (bfloat16), each
configuration measured in this one process (rank 0; rank 1 in a worker):

- `from_pretrained` to ready; decode ms/step at batch 1 and 32; time to first token of a
  256- and a 1024-token text prompt (from the call, `RequestOutput.metrics`);
- the collectives alone, measured in 2 processes on the same GPUs: one all-reduce of a
  [rows, hidden] bfloat16 tensor, replayed from a CUDA graph of 64 of them, and the share of a
  decode step they make up (2 per layer + the embedding's; the logits' all-gather apart);
- with a second checkpoint, float32 greedy agreement TP=1 vs TP=2 over 32 image prompts.

`vit CHECKPOINT`: the vision tower alone, TP=1 against TP=2 with each `vit_parallel` mode
(bfloat16): images/s encoding 64 448 px and 16 1344 px images per call (the engine's packs), and
the latency of one 448 and one 1344 px image.

`fp8 CHECKPOINT`: bfloat16 and `quantization="fp8"` at TP=1 and TP=2: decode ms/step at batch 1
and 32 (FP8), and the first-token distribution of 16 image prompts against bfloat16 at TP=1 (mean
KL, logits' relative error, top-1 agreement). FP8 at TP=2 is not bit-equal to TP=1 by design:
each rank quantizes its own part of a row-parallel layer's input per token.

    PYTHONPATH=. python docs/bench/tp_figures.py CHECKPOINT [FLOAT32_CHECKPOINT]
    PYTHONPATH=. python docs/bench/tp_figures.py vit CHECKPOINT
    PYTHONPATH=. python docs/bench/tp_figures.py fp8 CHECKPOINT
"""
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

from docs.bench.fp8_figures import decode_ms, ttft_ms
from mmpipe import Pipeline, SamplingParams
from mmpipe.pipeline import caption_conversation
from tests.helpers import random_image


def _collective_rank(rank: int, port: int, hidden: int, vocab: int, out: dict) -> None:
    import torch.distributed as dist

    from mmpipe.engine.tensor_parallel import join_group
    from mmpipe.layers.parallel import TPGroup

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    group = join_group(TPGroup(rank, 2), store, torch.device("cuda", rank))
    result = {}
    for rows in (1, 32, 256, 1024):
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(rows, vocab // 2, device="cuda", dtype=torch.float32)
        for name, fn in (("all_reduce", lambda: group.all_reduce(x)),
                         ("logits_all_gather", lambda: group.all_gather_last(logits))):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(64):
                    fn()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            result[f"{name}_us_rows{rows}"] = round((time.perf_counter() - start) / (20 * 64) * 1e6, 2)
    if rank == 0:
        out.update(result)
    torch.cuda.synchronize()
    os._exit(0)  # no orderly NCCL teardown (see mmpipe.engine.tensor_parallel._abort)


def collectives(hidden: int, vocab: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_collective_rank, args=(port, hidden, vocab, out), nprocs=2, join=True)
    return dict(out)


def _agreement(runs: list) -> tuple[str, float]:
    same = sum(a == b for a, b in zip(*runs))
    positions = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(*runs)) / sum(len(a) for a in runs[0])
    return f"{same}/{len(runs[0])}", round(positions, 4)


def _image_prompts() -> list:
    return [caption_conversation(random_image(448, 448, seed=i), "Describe this image.") for i in range(32)]


def agreement(path: str) -> dict:
    convs = _image_prompts()
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    runs = []
    for size in (1, 2):
        pipe = Pipeline.from_pretrained(path, dtype="float32", tensor_parallel_size=size, startup_progress=False)
        runs.append([o.token_ids for o in pipe.chat(convs, greedy, progress=False)])
        pipe.close()
    same, positions = _agreement(runs)
    return {"float32_identical_sequences": same, "float32_positionwise_agreement": positions}


def _timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _profile(fn) -> dict:
    """Rank 0's host time per call (returning, before the GPU is done) and its GPU kernels' time
    by kind over 10 calls: where a tensor-parallel tower's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.key[:60], round(e.device_time_total / 10 / 1e3, 3)) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda kv: -kv[1])[:8]
    return {"host_ms": round(host * 1e3, 2), "device_ms_per_call_top": kernels}


def vit(path: str) -> None:
    """The vision tower through the engine's own encode path (rank 0's runner: shares sent to
    the workers, or every pack run on every rank's shard), each configuration in turn."""
    for size, mode in ((1, "data"), (2, "data"), (2, "tensor"), (2, "rank0"), (1, "data")):
        pipe = Pipeline.from_pretrained(path, tensor_parallel_size=size, vit_parallel=mode, startup_progress=False)
        line = {"tensor_parallel_size": size, "vit_parallel": mode if size > 1 else "-"}
        for side, count in ((448, 64), (1344, 16)):
            images = [pipe.processor.load_image(random_image(side, side, seed=side + i), "probe") for i in range(count)]
            line[f"images_per_s_{side}"] = round(count / _timed(lambda: pipe.runner.encode_images(images), 5), 1)
            line[f"one_image_ms_{side}"] = round(_timed(lambda: pipe.runner.encode_images(images[:1]), 20) * 1e3, 2)
        if mode == "tensor":
            line["profile"] = _profile(lambda: pipe.runner.encode_images(images[:1]))
        stats = pipe.stats()
        line["vit_runs"] = {k: stats["vit"][k] for k in ("graphs", "graph_runs", "eager_runs")}
        if size > 1:
            line["worker_vit_runs"] = stats["tensor_parallel"]["worker_vit_runs"]
        print(json.dumps(line), flush=True)
        pipe.close()
        torch.cuda.empty_cache()


def fp8(path: str) -> None:
    """bfloat16 and `quantization="fp8"` at TP=1 and TP=2: decode ms/step (FP8), and each
    configuration's first-token distribution over 16 image prompts against bfloat16 at TP=1
    (mean KL, relative error of the logits, top-1 agreement)."""
    from tests.helpers import first_logits

    convs = _image_prompts()[:16]
    reference = None
    for quantization, size in ((None, 1), (None, 2), ("fp8", 1), ("fp8", 2)):
        pipe = Pipeline.from_pretrained(path, tensor_parallel_size=size, quantization=quantization,
                                        startup_progress=False)
        line = {"tensor_parallel_size": size, "quantization": quantization or "bf16"}
        if quantization:
            for batch in (1, 32):
                line[f"decode_ms_b{batch}"] = round(decode_ms(pipe, batch), 3)
        logits = torch.stack([first_logits(pipe, conv).float() for conv in convs])
        if reference is None:
            reference = logits
        else:
            p, q = reference.log_softmax(-1), logits.log_softmax(-1)
            line["mean_kl_vs_bf16_tp1"] = round((p.exp() * (p - q)).sum(-1).mean().item(), 6)
            line["logits_rel_err_vs_bf16_tp1"] = round(((logits - reference).norm() / reference.norm()).item(), 5)
            line["top1_agreement_vs_bf16_tp1"] = round((logits.argmax(-1) == reference.argmax(-1)).float().mean().item(), 3)
        print(json.dumps(line), flush=True)
        pipe.close()
        torch.cuda.empty_cache()


def main() -> None:
    print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), flush=True)
    if sys.argv[1] in ("vit", "fp8"):
        return (vit if sys.argv[1] == "vit" else fp8)(sys.argv[2])
    path = sys.argv[1]
    for size in (1, 2):
        start = time.perf_counter()
        pipe = Pipeline.from_pretrained(path, tensor_parallel_size=size, startup_progress=False)
        line = {"tensor_parallel_size": size, "from_pretrained_s": round(time.perf_counter() - start, 1)}
        for batch in (1, 32):
            line[f"decode_ms_b{batch}"] = round(decode_ms(pipe, batch), 3)
        for n in (256, 1024):
            line[f"ttft_ms_{n}"] = round(ttft_ms(pipe, n), 2)
        stats = pipe.stats()
        line["graphs"] = {k: stats[k]["graphs"] for k in ("decode", "prefill")}
        line["capture_failures"] = {k: stats[k]["capture_failures"] for k in ("decode", "prefill")}
        cfg = pipe.model.language.cfg
        layers, hidden, vocab = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
        print(json.dumps(line), flush=True)
        pipe.close()
        del pipe
        torch.cuda.empty_cache()
    comm = collectives(hidden, vocab)
    comm["all_reduces_per_decode_step"] = 2 * layers + 1
    print(json.dumps(comm), flush=True)
    if len(sys.argv) > 2:
        print(json.dumps(agreement(sys.argv[2])), flush=True)


if __name__ == "__main__":
    main()
