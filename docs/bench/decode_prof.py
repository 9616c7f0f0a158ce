"""Kernel time per decode step (graphs) at a few batch sizes: which kernels, how long, how many."""
import collections, sys, time, torch
from torch.profiler import profile, ProfilerActivity
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_decode import MmpipeSystem, make_prompts
ck = build_3b_checkpoint("/tmp/ck3b")
batches = [int(b) for b in (sys.argv[1:] or ["1", "32"])]
system = MmpipeSystem(ck, torch.device("cuda"), "bfloat16", "full_and_piecewise", 2048, max(batches))
for batch in batches:
    prompts = make_prompts(ck, batch, 256)
    system.run(prompts, 8)
    torch.cuda.synchronize()
    t0 = time.perf_counter(); system.run(prompts, 40); torch.cuda.synchronize(); t40 = time.perf_counter() - t0
    t0 = time.perf_counter(); system.run(prompts, 104); torch.cuda.synchronize(); t104 = time.perf_counter() - t0
    print(f"batch {batch}: {(t104 - t40) / 64 * 1e3:.3f} ms/step wall")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        system.run(prompts, 65)
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            a = agg[e.name[:90]]; a[0] += 1; a[1] += e.device_time_total
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    steps = 64
    total = 0.0
    print(f"{'kernel':90s} {'count/step':>10s} {'us/step':>9s} {'us/call':>8s}")
    for name, (n, us) in rows[:28]:
        print(f"{name:90s} {n/steps:10.1f} {us/steps:9.1f} {us/n:8.2f}")
    total = sum(v[1] for v in agg.values()) / steps
    print(f"kernel sum per step (incl. prefill share) {total:.1f} us")
