"""Captioning with the prefill graphs captured up to 2048 tokens (the default: larger steps run
their pieces eagerly, every kernel launched by the host) against a schedule extended to 8192 in
512-token steps (captioning's chunks are ~4000 tokens). One process, a Pipeline per
configuration; each warmed by one pass over the files (every decode batch size seen), then the
best of two passes with the encoder cache cleared. Prints from_pretrained seconds, images/s and
the main thread's CPU seconds per image.
Usage: python docs/bench/runs/prefill_graph_sizes_ab.py CKPT IMAGE_DIR QUANTIZATIONS (e.g. bf16,fp8-all)"""
import os, sys, time
import torch
from mmpipe import Pipeline, SamplingParams
from mmpipe.config import GraphConfig
from mmpipe.language.prefill_graphs import STARTUP_PREFILL_SIZES
from mmpipe.pipeline import caption_conversation

ck, folder = sys.argv[1], sys.argv[2]
paths = sorted(os.path.join(folder, f) for f in os.listdir(folder))
convs = [caption_conversation(p, "Describe this image.") for p in paths]
params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)
extended = GraphConfig(buckets=STARTUP_PREFILL_SIZES + tuple(range(2560, 8193, 512)))


def passes(pipe):
    out = []
    for i in range(3):
        pipe.engine.drain(); pipe.engine.cache.clear(); torch.cuda.synchronize()
        cpu, t = time.thread_time(), time.perf_counter()
        done = sum(1 for _ in pipe.chat_stream(iter(convs), params))
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
        assert done == len(convs)
        if i:  # the first pass warms every size
            out.append((len(convs) / wall, cpu / len(convs) * 1e3))
    return max(out)


for q in sys.argv[3].split(","):
    for name, graphs in (("to 2048", GraphConfig()), ("to 8192", extended), ("to 2048", GraphConfig()), ("to 8192", extended)):
        t = time.perf_counter()
        pipe = Pipeline.from_pretrained(ck, quantization=None if q == "bf16" else q, prefill_graph=graphs,
                                        startup_progress=False)
        start = time.perf_counter() - t
        rate, ms = passes(pipe)
        print(f"{q} prefill graphs {name}: from_pretrained {start:.1f} s, {rate:.1f} images/s, "
              f"main thread {ms:.2f} ms CPU per image, graph pool {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved",
              flush=True)
        pipe.close(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
