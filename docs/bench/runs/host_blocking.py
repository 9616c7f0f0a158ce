"""Where the engine's host thread spends each phase of a captioning run: one profiled run of N
448 px JPEG captions (64 new tokens, warm Pipeline), its CUDA runtime calls and PyTorch ops summed
per host phase (mmpipe.trace ranges), longest first. A blocking call (a synchronize, a pageable
copy, cudaHostAlloc, cudaFree, a graph launch into a full queue) shows as a long runtime call.
Usage: python docs/bench/runs/host_blocking.py CKPT IMAGE_DIR [QUANTIZATION] [N]"""
import bisect, collections, json, os, sys, tempfile
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from mmpipe import Pipeline, SamplingParams
from mmpipe.pipeline import caption_conversation

ck, folder = sys.argv[1], sys.argv[2]
q = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "bf16" else None
n = int(sys.argv[4]) if len(sys.argv) > 4 else 256
paths = sorted(os.path.join(folder, f) for f in os.listdir(folder))[:n]
convs = [caption_conversation(p, "Describe this image.") for p in paths]
params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)
with Pipeline.from_pretrained(ck or None, quantization=q, startup_progress=False) as pipe:
    for _ in pipe.chat_stream(iter(convs[:64]), params):
        pass
    pipe.engine.drain(); pipe.engine.cache.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mmpipe.run"):
            for _ in pipe.chat_stream(iter(convs), params):
                pass
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "t.json"))
        events = json.load(open(os.path.join(tmp, "t.json")))["traceEvents"]
complete = [e for e in events if e.get("ph") == "X"]
phases = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"][7:], e["tid"]) for e in complete
                if e.get("cat") == "user_annotation" and e["name"].startswith("mmpipe.") and e["name"] != "mmpipe.run")
starts = [p[0] for p in phases]
run = [e for e in complete if e.get("name") == "mmpipe.run"][0]
main_tid = run["tid"]


def phase_at(ts, tid):
    i = bisect.bisect_right(starts, ts) - 1
    for p in phases[max(0, i - 4):i + 1][::-1]:
        if p[0] <= ts <= p[1] and p[3] == tid:
            return p[2]
    return "none"


wall = float(run["dur"]) / 1e6
per_phase = collections.Counter()
for p in phases:
    if p[3] == main_tid:
        per_phase[p[2]] += (p[1] - p[0]) / 1e6
print(f"{q or 'bf16'}: {n} images, profiled wall {wall:.2f} s; main-thread seconds per phase:",
      {k: round(v, 3) for k, v in per_phase.most_common()})
for cat in ("cuda_runtime", "cuda_driver", "cpu_op"):
    sums = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for e in complete:
        if e.get("cat") != cat or e["tid"] != main_tid:
            continue
        key = (phase_at(float(e["ts"]), e["tid"]), e["name"][:60])
        s = sums[key]; d = float(e.get("dur", 0)) / 1e6
        s[0] += d; s[1] += 1; s[2] = max(s[2], d)
    print(f"-- {cat} on the main thread (phase, name: total s, calls, longest ms), top 14")
    for (ph, name), (tot, calls, longest) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {ph:9s} {name:60s} {tot:7.3f} {calls:6d} {longest * 1e3:8.2f}")
