"""Where a warm captioning pass's copies and memsets come from: every GPU memcpy / memset (and
graph memcpy kernels such as `memcpy128`) mapped, by its correlation id, to the CUDA runtime call
that issued it (cudaMemcpyAsync, cudaMemsetAsync, cudaGraphLaunch, ...) and to the innermost
Python frames around that call. Prints ms per image and counts per (runtime call, frames).
Usage: python docs/bench/runs/copy_sources.py CKPT N QUANT"""
import bisect
import collections
import json
import os
import sys
import tempfile

import torch
from mmpipe.app.bench.caption import write_jpegs
from torch.profiler import ProfilerActivity, profile

from mmpipe import Pipeline, SamplingParams
from mmpipe.pipeline import caption_conversation

ck, n, quant = sys.argv[1], int(sys.argv[2]), sys.argv[3]
paths = write_jpegs(os.path.join(tempfile.mkdtemp(), "images"), n)
convs = [caption_conversation(p, "Describe this image.") for p in paths]
params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)
dev = "cuda" if torch.cuda.is_available() else "cpu"


def copy_like(e: dict) -> bool:
    name = e.get("name", "")
    return (e.get("cat") in ("gpu_memcpy", "gpu_memset")
            or (e.get("cat") == "kernel" and ("memcpy" in name.lower() or "memset" in name.lower()
                                             or "direct_copy" in name)))


with Pipeline.from_pretrained(ck, device=dev, dtype="bfloat16", startup_progress=False,
                              quantization=None if quant == "bf16" else quant) as pipe:
    for _ in range(2):
        list(pipe.chat_stream(iter(convs), params))
    pipe.engine.drain(); pipe.engine.cache.clear()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts, with_stack=True) as prof:
        list(pipe.chat_stream(iter(convs), params))
        if dev == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "t.json"))
        ev = json.load(open(os.path.join(tmp, "t.json")))["traceEvents"]

xs = [e for e in ev if e.get("ph") == "X"]
runtime = {e["args"]["correlation"]: e for e in xs
           if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
frames = collections.defaultdict(list)  # tid -> python frames sorted by start
for e in xs:
    if e.get("cat") == "python_function":
        frames[e["tid"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
starts = {}
for tid, fs in frames.items():
    fs.sort()
    starts[tid] = [f[0] for f in fs]


def around(tid, t: float, depth: int = 5) -> str:
    fs = frames.get(tid, [])
    i = bisect.bisect_right(starts.get(tid, []), t)
    inside = [f for f in fs[max(0, i - 4000):i] if f[1] >= t]
    inside.sort(key=lambda f: f[1] - f[0])  # innermost first
    keep = [f[2] for f in inside if "torch/" not in f[2] and "<built-in" not in f[2]][:depth]
    return " < ".join(k.split("/")[-1] for k in keep)


total = collections.Counter()
count = collections.Counter()
for e in xs:
    if not copy_like(e):
        continue
    r = runtime.get(e.get("args", {}).get("correlation"))
    key = (e["name"][:40], r["name"] if r else "?", around(r["tid"], float(r["ts"])) if r else "?")
    total[key] += float(e["dur"]) / 1e3 / n
    count[key] += 1
print(torch.cuda.get_device_name() if dev == "cuda" else "cpu",
      f"{n} files {quant}: copies and memsets by source")
for key, ms in total.most_common(25):
    print(f"  {ms:7.4f} ms/image {count[key]:6d} x  {key[0]} | {key[1]} | {key[2]}")
