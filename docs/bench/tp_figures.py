"""Tensor parallelism on 2 GPUs: TP=1 against TP=2 on a random checkpoint (bfloat16), each
configuration measured in this one process (rank 0; rank 1 in a worker):

- `from_pretrained` to ready; decode ms/step at batch 1 and 32; time to first token of a
  256- and a 1024-token text prompt (from the call, `RequestOutput.metrics`);
- the collectives alone, measured in 2 processes on the same GPUs: one all-reduce of a
  [rows, hidden] bfloat16 tensor, replayed from a CUDA graph of 64 of them, and the share of a
  decode step they make up (2 per layer + the embedding's; the logits' all-gather apart);
- with a second checkpoint, float32 greedy agreement TP=1 vs TP=2 over 32 image prompts.

    PYTHONPATH=. python docs/bench/tp_figures.py CHECKPOINT [FLOAT32_CHECKPOINT]
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


def agreement(path: str) -> dict:
    convs = [caption_conversation(random_image(448, 448, seed=i), "Describe this image.") for i in range(32)]
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    runs = []
    for size in (1, 2):
        pipe = Pipeline.from_pretrained(path, dtype="float32", tensor_parallel_size=size, startup_progress=False)
        runs.append([o.token_ids for o in pipe.chat(convs, greedy, progress=False)])
        pipe.close()
    same = sum(a == b for a, b in zip(*runs))
    positions = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(*runs)) / sum(len(a) for a in runs[0])
    return {"float32_identical_sequences": f"{same}/{len(convs)}", "float32_positionwise_agreement": round(positions, 4)}


def main() -> None:
    path = sys.argv[1]
    print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), flush=True)
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
