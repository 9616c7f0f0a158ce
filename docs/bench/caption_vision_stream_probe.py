"""A/B of the ViT on its own stream in captioning (H100): in line vs stream (priority 0 and -1),
alternating, 1024 files; then one profiled 256-file run each: how much ViT time overlaps LM time."""
import json, os, sys, tempfile, time
import torch
from mmpipe import Pipeline, SamplingParams
from mmpipe.pipeline import caption_conversation
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_caption import write_jpegs
from mmpipe.app import timeline

ck = build_3b_checkpoint("/tmp/ck3b")
paths = write_jpegs("/tmp/capwork/images", 1024)
params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)
convs = [caption_conversation(p, "Describe this image.") for p in paths]
pipe = Pipeline.from_pretrained(ck, device="cuda", dtype="bfloat16", startup_progress=False)
runner, engine = pipe.runner, pipe.engine

def set_variant(name):
    engine.drain(); torch.cuda.synchronize()
    if name == "inline":
        runner.use_vision_stream(False)
    else:
        runner.use_vision_stream(False)
        torch.cuda.synchronize()
        runner.vision_stream = torch.cuda.Stream(priority=0 if name == "stream p0" else -1)

def run(n):
    engine.drain(); engine.cache.clear(); torch.cuda.synchronize()
    t = time.perf_counter()
    done = sum(1 for _ in pipe.chat_stream(iter(convs[:n]), params))
    torch.cuda.synchronize()
    assert done == n
    return time.perf_counter() - t

variants = ["inline", "stream p0", "stream p-1"]
for v in variants:
    set_variant(v); run(64); run(256)  # warm-up, every ViT pack size likely captured
res = {v: [] for v in variants}
for r in range(3):
    for v in (variants if r % 2 == 0 else variants[::-1]):
        set_variant(v)
        res[v].append(1024 / run(1024))
print(torch.cuda.get_device_name(), "1024 files, images/s per round:")
for v in variants:
    print(f"  {v:12s}", " ".join(f"{x:6.1f}" for x in res[v]), f" mean {sum(res[v])/len(res[v]):6.1f}")

from torch.profiler import ProfilerActivity, profile, record_function
def union(iv):
    tot, reach = 0.0, float("-inf")
    for s, e in sorted(iv):
        if e <= reach: continue
        tot += e - max(s, reach); reach = e
    return tot
for v in variants:
    set_variant(v); engine.drain(); engine.cache.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mmpipe.run"):
            for _ in pipe.chat_stream(iter(convs[:256]), params): pass
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json"); prof.export_chrome_trace(path)
        ev = timeline.load_trace(path)
    run_ev = [e for e in ev if e.get("ph") == "X" and e.get("name") == "mmpipe.run"]
    lo = min(float(e["ts"]) for e in run_ev); hi = max(float(e["ts"]) + float(e["dur"]) for e in run_ev)
    ks = [e for e in ev if e.get("ph") == "X" and e.get("cat") in timeline.GPU_CATEGORIES]
    by = {}
    for e in ks:
        s = float(e["ts"]); by.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append((s, s + float(e.get("dur", 0))))
    allu = union([x for l in by.values() for x in l]); wall = hi - lo
    per = {k: union(l) for k, l in by.items()}
    print(f"{v:12s} profiled {256/(wall/1e6):6.1f} img/s; busy {allu/wall:.3f}; per stream busy "
          + ", ".join(f"{k}: {x/wall:.3f} ({len(by[k])} kernels)" for k, x in sorted(per.items(), key=lambda kv: -kv[1])[:3])
          + f"; overlap {(sum(per.values()) - allu)/wall:.3f} of wall")
