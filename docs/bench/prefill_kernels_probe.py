"""Every GPU activity of one 64- and 256-token prefill request (TTFT path), by name. $OUT/p20.txt"""
import os, collections
import torch
from torch.profiler import profile, ProfilerActivity
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_prefill import MmpipeTTFT
from mmpipe.app.bench_decode import make_prompts
OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p20.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()
ck = build_3b_checkpoint("/tmp/ck3b")
system = MmpipeTTFT(ck, "full_and_piecewise")
say("#", torch.cuda.get_device_name())
for n in (64, 256):
    fn = system.request_fn(token_ids=make_prompts(ck, 1, n, seed=n)[0])
    for _ in range(10): fn()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            a = agg[e.name[:100]]; a[0] += 1; a[1] += e.device_time_total
    tot_n = sum(v[0] for v in agg.values()) / reps; tot_t = sum(v[1] for v in agg.values()) / reps
    say(f"## {n} tokens: {tot_n:.0f} activities, {tot_t:.0f} us per request")
    for name, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        say(f"{c/reps:7.1f} {t/reps:9.1f} us  {t/c:7.2f} us/call  {name}")
