"""In-process A/B of the prefill host path before the first replay: the old path (two uploads,
a gather, two copies and a fill, the per-token loops of assembly) against the current one (one
upload, one staging kernel), alternating request by request in one process. Run from the
repository root with the old tree unpacked at runs/probe/head (`git archive 29e02d6~1 mmpipe app
language vision | tar -x -C runs/probe/head`); output in $OUT/p12.txt."""
import os, statistics, subprocess, sys, time
import numpy as np
import torch
from mmpipe.app.bench import build_3b_checkpoint, _kernel_ms
from mmpipe.app.bench_prefill import MmpipeTTFT, cases_of
from mmpipe.engine import model_runner as mr
from mmpipe.language import prefill_graphs as pg
from mmpipe.language.attention import AttentionMetadata
from mmpipe.runtime.context import ForwardContext, forward_context
from mmpipe.runtime.transfer import to_device

OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p12.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()

def old_upload(self, device):
    t, b = self.token_ids.shape[0], self.seq_lens.shape[0]
    qsl = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(self.query_lens, out=qsl[1:])
    longs = [self.token_ids, self.positions.reshape(-1), self.slot_mapping, self.logit_rows]
    ints = [self.seq_lens.astype(np.int32), qsl, self.page_table.reshape(-1).astype(np.int32)]
    ids, pos, slots, logit_rows = to_device(np.concatenate(longs), device).split([p.shape[0] for p in longs])
    lens, cu, table = to_device(np.concatenate(ints), device).split([p.shape[0] for p in ints])
    meta = AttentionMetadata(
        is_decode=False, num_tokens=t, slot_mapping=slots, seq_lens=lens,
        query_start_loc=cu, page_table=table.view(b, -1),
        seq_lens_host=self.seq_lens.tolist(), query_lens_host=self.query_lens.tolist(),
        max_query_len=int(self.query_lens.max()), max_seq_len=int(self.seq_lens.max()))
    return mr.PrefillTensors(ids, pos.view(3, t), meta, logit_rows, None)

def old_forward(self, token_ids, positions, images, meta, count=None):
    n = token_ids.shape[0]
    self.lm.embed(token_ids, out=self.input_embeds[:n])
    for span in images:
        self.input_embeds[span.row:span.row + span.values.shape[0]].copy_(span.values)
    self.positions[:n].copy_(positions.t())
    size = self.size_for(n)
    with forward_context(ForwardContext(meta, self.kv.layers, self.lm.attention)):
        self.slots[:n].copy_(meta.slot_mapping)
        graphed = self.cache is not None and size not in self.state.failed_sizes \
            and (self.state.generation, size, 0) in self.cache
        self.state.size = size if graphed else None
        hidden = self.state.run_planned(size, lambda: self._run_compiled(size))
    self.slots[:n].fill_(self.dummy_slot)
    return hidden


import importlib.util
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod
H = "runs/probe/head/"
h_mrope = load("h_mrope", H + "language/mrope.py")
h_proc = load("h_proc", H + "mmpipe/engine/processor.py")
h_proc.mrope_positions = h_mrope.mrope_positions
h_req = load("h_req", H + "mmpipe/engine/request.py")
h_mr = load("h_mr", H + "mmpipe/engine/model_runner.py")
from mmpipe.engine import processor as proc, request as req
NEW = {"assemble": proc.InputProcessor.assemble, "tokens": req.Request.tokens,
       "build": mr.PrefillInputs.__dict__["build"], "upload": mr.PrefillInputs.upload,
       "forward": pg.PrefillRunner.forward}
OLD = {"assemble": h_proc.InputProcessor.assemble, "tokens": h_req.Request.tokens,
       "build": h_mr.PrefillInputs.__dict__["build"], "upload": old_upload, "forward": old_forward}
def use(old):
    f = OLD if old else NEW
    proc.InputProcessor.assemble = f["assemble"]; req.Request.tokens = f["tokens"]
    mr.PrefillInputs.build = f["build"]; mr.PrefillInputs.upload = f["upload"]; pg.PrefillRunner.forward = f["forward"]
first = {}
orig_replay = torch.cuda.CUDAGraph.replay
def replay(self):
    first.setdefault("t", time.perf_counter()); return orig_replay(self)
torch.cuda.CUDAGraph.replay = replay

say("#", torch.cuda.get_device_name(), "affinity", sorted(os.sched_getaffinity(0)))
try:
    pass
except Exception as e:
    say("topo:", e)
ck = build_3b_checkpoint("/tmp/ck3b")
system = MmpipeTTFT(ck, "full_and_piecewise")
cases = cases_of(ck, [64, 256])

def one(fn):
    first.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter(); fn(); t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (first.get("t", t1) - t0) * 1e3

def ab(label, reps=120):
    for name, kw in cases:
        fn = system.request_fn(**kw)
        res = {True: [], False: []}
        for old in (True, False):
            use(old)
            for _ in range(5): fn()
        for i in range(reps):
            old = bool(i % 2)
            use(old)
            res[old].append(one(fn))
        use(False)
        k = _kernel_ms(fn)
        line = []
        for old in (True, False):
            ttft = statistics.median(r[0] for r in res[old]); fr = statistics.median(r[1] for r in res[old])
            line.append(f"{'old' if old else 'new'} TTFT {ttft:.3f} first replay {fr:.3f} ratio {ttft / k:.3f}")
        say(f"| {label} {name:8s} kernels {k:.3f} | " + " | ".join(line))

ab("A/B", reps=200)
ab("A/B again", reps=200)
