"""Decode ms/step with the few-row products reading their first weight tile before PDL's wait
(MMPIPE_PDL_PREFETCH=1, the default) or after it (0); FP8 and bfloat16; one process, a Pipeline
per configuration, in the order given. ms/step from differencing two generation lengths (16 and
80 new tokens, best of three each), prompts of ~20 tokens; batch 1 also as a share of the
weight-read floor (LM weight bytes, an untied input embedding left out, / copy bandwidth). With --profile B: per-kernel GPU time of a
batch-B decode step for each configuration (torch.profiler over a 64-token generation).
Usage: python docs/bench/runs/pdl_prefetch_ab.py CKPT [BATCHES] [CONFIGS] [--profile B]
  BATCHES: comma-separated (default 1,8,32); CONFIGS: e.g. fp8:0,fp8:1,bf16:0,bf16:1"""
# (Each configuration captures its own decode graphs, so the switch read at capture time applies.)
import collections
import os
import sys

import torch

from mmpipe import settings
from mmpipe.app.bench.main import copy_bandwidth
from decode_switch_ab import batch_timings, generate  # this folder is sys.path[0]

args = [a for a in sys.argv[1:] if not a.startswith("--")]
profile = int(sys.argv[sys.argv.index("--profile") + 1]) if "--profile" in sys.argv else 0
if profile:
    args.remove(str(profile))
ck = args[0]
batches = [int(b) for b in (args[1] if len(args) > 1 else "1,8,32").split(",")]
configs = (args[2] if len(args) > 2 else "fp8:0,fp8:1,bf16:0,bf16:1").split(",")
bw = copy_bandwidth() * 1e9
print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

for config in configs:
    quant, prefetch = config.split(":")
    os.environ["MMPIPE_PDL_PREFETCH"] = prefetch
    settings.refresh()
    pipe, floor, times = batch_timings(ck, quant, batches, bw)
    row = []
    for b, ms in zip(batches, times):
        share = f" ({floor / ms:.0%} of the {floor:.2f} ms floor)" if b == 1 else ""
        row.append(f"b{b} {ms:.3f}")
        print(f"{config:8s} decode batch {b:3d}: {ms:.3f} ms/step{share}", flush=True)
    print(f"{config:8s} " + " | ".join(row), flush=True)
    if profile:
        generate(pipe, profile, 64)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            generate(pipe, profile, 64)
            torch.cuda.synchronize()
        per = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += 1
                per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        steps = 64
        print(f"{config} profile, batch {profile}: kernel, calls/step, us/step, us/call", flush=True)
        total = 0.0
        for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:16]:
            total += us
            print(f"  {name[:70]:70s} {count / steps:6.1f} {us / steps:8.1f} {us / count:7.2f}", flush=True)
        print(f"  sum of kernels per step (top 16, incl. prefill share): {total / steps:.1f} us", flush=True)
    pipe.close()
    torch.cuda.empty_cache()
