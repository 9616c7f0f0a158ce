"""64-token and 256-token TTFT host marks on the host path of commit 25f7453 (before PackedUploader; median of 40). Output $OUT/p17.txt"""
import functools, importlib, os, statistics, time
import torch
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_prefill import MmpipeTTFT
from mmpipe.app.bench_decode import make_prompts
OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p17.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()
ck = build_3b_checkpoint("/tmp/ck3b")
system = MmpipeTTFT(ck, "full_and_piecewise")
say("#", torch.cuda.get_device_name())
marks, order = {}, []
def mark(k):
    if k not in marks:
        marks[k] = time.perf_counter(); order.append(k)
def wrap_attr(owner, name, label):
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    fn = getattr(owner, name)
    @functools.wraps(fn)
    def w(*a, **k):
        mark(label + " >")
        try: return fn(*a, **k)
        finally: mark(label + " <")
    setattr(owner, name, staticmethod(w) if isinstance(raw, staticmethod) else w)
for m, q in [("mmpipe.engine.processor", "InputProcessor.assemble"), ("mmpipe.engine.engine", "Engine.add"),
             ("mmpipe.engine.engine", "Engine.step"), ("mmpipe.engine.scheduler", "Scheduler.schedule"),
             ("mmpipe.engine.engine", "Engine._launch"), ("mmpipe.engine.model_runner", "ModelRunner.prefill"),
             ("mmpipe.engine.model_runner", "PrefillInputs.upload"),
             ("mmpipe.language.prefill_graphs", "PrefillRunner.forward"),
             ("mmpipe.runtime.piecewise", "ReplayPlan.run"),
             ("mmpipe.language.qwen2", "Qwen2LanguageModel.compute_logits"),
             ("mmpipe.engine.model_runner", "ModelRunner.launch_sample"), ("mmpipe.engine.engine", "Engine._read"),
             ("mmpipe.engine.model_runner", "ModelRunner.apply_tokens"), ("mmpipe.engine.model_runner", "ModelRunner.release"),
             ("mmpipe.language.sampler", "HostTokens.get")]:
    mod = importlib.import_module(m); cls, name = q.split(".")
    wrap_attr(getattr(mod, cls), name, q)
import mmpipe.engine.model_runner as mr, mmpipe.language.prefill_graphs as pg
# PrefillInputs.build is a classmethod
orig_build = mr.PrefillInputs.build
def build(*a, **k):
    mark("build >"); r = orig_build(*a, **k); mark("build <"); return r
mr.PrefillInputs.build = build
wrap_attr(mr, "to_device_packed", "to_device_packed")
wrap_attr(pg, "stage_rows", "stage_rows")
orig_replay = torch.cuda.CUDAGraph.replay
def replay(self):
    mark("first graph replay >"); r = orig_replay(self); mark("first graph replay <"); return r
torch.cuda.CUDAGraph.replay = replay
def measure(fn, reps=48):
    rows = []
    for i in range(reps):
        marks.clear(); order.clear(); torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); torch.cuda.synchronize()
        r = {k: (marks[k] - t0) * 1e3 for k in order}; r["end"] = (t1 - t0) * 1e3; rows.append(r)
    rows = rows[8:]
    keys = [k for k in rows[-1] if all(k in r for r in rows)]
    for k in sorted(keys, key=lambda k: statistics.median(r[k] for r in rows)):
        say(f"|   {k:45s} {statistics.median(r[k] for r in rows):8.3f}")
for n in (64, 256):
    fn = system.request_fn(token_ids=make_prompts(ck, 1, n, seed=n)[0])
    for _ in range(20): fn()
    say(f"## {n} tokens, median ms from request start")
    measure(fn)
