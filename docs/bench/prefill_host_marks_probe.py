"""(Written for the host path before 29e02d6: embed / to_device marks.) 64-token TTFT host timeline, ordered marks (first entry / first exit), in 3 conditions:
normal (GPU idle at request start), GPU busy (sleep kernel queued first), gc disabled."""
import functools, gc, importlib, os, statistics, time, sys
import torch
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_prefill import MmpipeTTFT
from mmpipe.app.bench_decode import make_prompts

OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p8.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()

ck = build_3b_checkpoint("/tmp/ck3b")
system = MmpipeTTFT(ck, "full_and_piecewise")
say("#", torch.cuda.get_device_name())
marks = {}
order = []
def mark(k):
    if k not in marks:
        marks[k] = time.perf_counter(); order.append(k)
def wrap(modname, qual):
    mod = importlib.import_module(modname)
    owner = mod
    parts = qual.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    raw = owner.__dict__.get(parts[-1]) if isinstance(owner, type) else None
    fn = getattr(owner, parts[-1])
    @functools.wraps(fn)
    def w(*a, **k):
        mark(qual + " >")
        try:
            return fn(*a, **k)
        finally:
            mark(qual + " <")
    if isinstance(raw, staticmethod): w = staticmethod(w)
    elif isinstance(raw, classmethod): w = classmethod(lambda cls, *a, **k: (mark(qual + " >"), fn(*a, **k), mark(qual + " <"))[1])
    setattr(owner, parts[-1], w)
for m, q in [("mmpipe.engine.processor", "InputProcessor.assemble"),
             ("mmpipe.engine.engine", "Engine.add"),
             ("mmpipe.engine.engine", "Engine.step"),
             ("mmpipe.engine.scheduler", "Scheduler.schedule"),
             ("mmpipe.engine.engine", "Engine._launch"),
             ("mmpipe.engine.model_runner", "ModelRunner.prefill"),
             ("mmpipe.engine.model_runner", "PrefillInputs.build"),
             ("mmpipe.engine.model_runner", "PrefillInputs.upload"),
             ("mmpipe.language.prefill_graphs", "PrefillRunner.forward"),
             ("mmpipe.language.qwen2", "Qwen2LanguageModel.embed"),
             ("mmpipe.language.prefill_graphs", "PrefillRunner.size_for"),
             ("mmpipe.runtime.piecewise", "PiecewiseState.run_planned"),
             ("mmpipe.runtime.piecewise", "ReplayPlan.run"),
             ("mmpipe.language.qwen2", "Qwen2LanguageModel.compute_logits"),
             ("mmpipe.engine.model_runner", "ModelRunner.launch_sample"),
             ("mmpipe.engine.engine", "Engine._read"),
             ("mmpipe.engine.model_runner", "ModelRunner.apply_tokens"),
             ("mmpipe.engine.model_runner", "ModelRunner.release"),
             ]:
    try:
        wrap(m, q)
    except Exception as exc:
        say("| cannot wrap", m, q, exc)
from mmpipe.runtime import transfer as tr
orig_td = tr.to_device
def td(*a, **k):
    i = sum(1 for x in order if x.startswith("to_device"))
    mark(f"to_device{i//2} >"); r = orig_td(*a, **k); mark(f"to_device{i//2} <"); return r
import mmpipe.engine.model_runner as _mr
_mr.to_device = td
orig_replay = torch.cuda.CUDAGraph.replay
def replay(self):
    mark("first graph replay >"); r = orig_replay(self); mark("first graph replay <"); return r
torch.cuda.CUDAGraph.replay = replay
from mmpipe.language import sampler as smp
orig_get = smp.HostTokens.get
def get(self):
    mark("HostTokens.get >"); r = orig_get(self); mark("HostTokens.get <"); return r
smp.HostTokens.get = get

def measure(fn, cond, reps=40):
    rows = []
    for i in range(reps):
        marks.clear(); order.clear()
        torch.cuda.synchronize()
        if cond == "gpu_busy":
            torch.cuda._sleep(int(3e6))  # ~1.5-2 ms at H100 clocks: host prepares while GPU busy
        if cond == "gc_off":
            gc.disable()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if cond == "gc_off":
            gc.enable()
        torch.cuda.synchronize()
        r = {k: (marks[k] - t0) * 1e3 for k in order}
        r["end"] = (t1 - t0) * 1e3
        rows.append(r)
    rows = rows[8:]
    keys = [k for k in rows[-1] if all(k in r for r in rows)]
    say(f"| {cond}: median ms from request start ({len(rows)} requests)")
    for k in sorted(keys, key=lambda k: statistics.median(r[k] for r in rows)):
        say(f"|   {k:40s} {statistics.median(r[k] for r in rows):8.3f}")

fn = system.request_fn(token_ids=make_prompts(ck, 1, 64, seed=64)[0])
for _ in range(20): fn()
for cond in ("normal", "gpu_busy", "gc_off", "normal"):
    measure(fn, cond)
# Hot-loop costs of the same host calls, for comparison.
import numpy as np
from mmpipe.runtime.transfer import to_device
dev = torch.device("cuda")
a = np.arange(400, dtype=np.int64)
torch.cuda.synchronize()
for name, f in [("to_device(400 int64)", lambda: orig_td(a, dev)),
                ("pin_memory only", lambda: torch.from_numpy(a).pin_memory()),
                ("torch.from_numpy", lambda: torch.from_numpy(a)),
                ("empty cuda 64x2048 bf16", lambda: torch.empty(64, 2048, device=dev, dtype=torch.bfloat16))]:
    for _ in range(50): f()
    t = time.perf_counter()
    for _ in range(500): f()
    say(f"| hot loop {name}: {(time.perf_counter() - t) / 500 * 1e6:.1f} us")
    torch.cuda.synchronize()
