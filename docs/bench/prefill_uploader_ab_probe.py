"""In-process A/B: the prefill host path of 25f7453 (to_device_packed, [3,T] positions; unpack it with
`git archive 25f7453 mmpipe app language vision | tar -x -C runs/probe/head`) vs the working
tree's (PackedUploader), alternating per request. Output $OUT/p18.txt"""
import os, statistics, sys, time, importlib.util
import torch
from mmpipe.app.bench import build_3b_checkpoint, _kernel_ms
from mmpipe.app.bench_prefill import MmpipeTTFT, cases_of
from mmpipe.engine import model_runner as mr
from mmpipe.language import prefill_graphs as pg
import mmpipe.runtime.transfer as tr
OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p18.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod
H = "runs/probe/head/"
h_tr = load("h_tr", H + "mmpipe/runtime/transfer.py")
tr.to_device_packed = h_tr.to_device_packed
h_stage = load("h_stage", H + "language/stage_inputs.py")
h_pg = load("h_pg", H + "language/prefill_graphs.py"); h_pg.stage_rows = h_stage.stage_rows
h_mr = load("h_mr", H + "mmpipe/engine/model_runner.py")
NEW = (mr.ModelRunner.prefill, pg.PrefillRunner.forward)
OLD = (h_mr.ModelRunner.prefill, h_pg.PrefillRunner.forward)
def use(old):
    mr.ModelRunner.prefill, pg.PrefillRunner.forward = OLD if old else NEW
first = {}
orig_replay = torch.cuda.CUDAGraph.replay
def replay(self):
    first.setdefault("t", time.perf_counter()); return orig_replay(self)
torch.cuda.CUDAGraph.replay = replay
say("#", torch.cuda.get_device_name())
ck = build_3b_checkpoint("/tmp/ck3b")
system = MmpipeTTFT(ck, "full_and_piecewise")
cases = cases_of(ck, [64, 256])
def one(fn):
    first.clear(); torch.cuda.synchronize()
    t0 = time.perf_counter(); out = fn(); t1 = time.perf_counter(); torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (first.get("t", t1) - t0) * 1e3, out
def ab(label, reps):
    for name, kw in cases:
        fn = system.request_fn(**kw)
        res = {True: [], False: []}
        toks = {True: set(), False: set()}
        for old in (True, False):
            use(old)
            for _ in range(5): fn()
        for i in range(reps):
            old = bool(i % 2); use(old)
            t, f, out = one(fn); res[old].append((t, f)); toks[old].add(tuple(out))
        use(False)
        k = _kernel_ms(fn)
        line = []
        for old in (True, False):
            ttft = statistics.median(r[0] for r in res[old]); fr = statistics.median(r[1] for r in res[old])
            line.append(f"{'old' if old else 'new'} TTFT {ttft:.3f} first replay {fr:.3f} ratio {ttft / k:.3f}")
        say(f"| {label} {name:8s} kernels {k:.3f} | " + " | ".join(line) + f" | same tokens {toks[True] == toks[False]}")
ab("A/B", 200)
ab("A/B again", 200)
