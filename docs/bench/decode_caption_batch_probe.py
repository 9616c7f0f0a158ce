"""Kernel time of a decode step at captioning's batch (224 rows, 256-token prompts), graphs on:
profile of 65 new tokens minus profile of 1 (the prefill), per kernel name."""
import collections, sys, time, torch
from torch.profiler import profile, ProfilerActivity
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_decode import MmpipeSystem, make_prompts
ck = build_3b_checkpoint("/tmp/ck3b")
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 224
system = MmpipeSystem(ck, torch.device("cuda"), "bfloat16", "full_and_piecewise", 8192, batch)
prompts = make_prompts(ck, batch, 256)
system.run(prompts, 8); torch.cuda.synchronize()
t0 = time.perf_counter(); system.run(prompts, 40); torch.cuda.synchronize(); t40 = time.perf_counter() - t0
t0 = time.perf_counter(); system.run(prompts, 104); torch.cuda.synchronize(); t104 = time.perf_counter() - t0
print(f"{torch.cuda.get_device_name()} batch {batch}: {(t104 - t40) / 64 * 1e3:.3f} ms/step wall")
def prof(n):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        system.run(prompts, n); torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            a = agg[e.name[:80]]; a[0] += 1; a[1] += e.device_time_total
    return agg
one, many = prof(1), prof(65)
rows = []
for name, (n, us) in many.items():
    n0, us0 = one.get(name, [0, 0.0])
    rows.append((name, (n - n0) / 64, (us - us0) / 64))
rows.sort(key=lambda r: -r[2])
print(f"{'kernel':80s} {'count/step':>10s} {'us/step':>9s} {'us/call':>8s}")
for name, n, us in rows[:30]:
    print(f"{name:80s} {n:10.1f} {us:9.1f} {us / n if n else 0:8.2f}")
print(f"decode kernel sum per step {sum(r[2] for r in rows):.1f} us; preemptions {system.pipe.engine.scheduler.preemptions}")
