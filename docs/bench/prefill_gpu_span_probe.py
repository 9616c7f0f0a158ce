"""GPU-only span of a prefill forward (host queued ahead behind a sleep kernel): piecewise vs one
full graph, against the kernel sum; and host cost of small uploads."""
import os, statistics, time
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_prefill import MmpipeTTFT
from mmpipe.app.bench_decode import make_prompts
from mmpipe.engine.model_runner import PrefillChunk, PrefillInputs
from mmpipe.language.attention import AttentionMetadata
from mmpipe.runtime.context import ForwardContext, forward_context
from mmpipe.runtime.transfer import PackedUploader
from mmpipe.runtime import transfer as tr

out = open(os.environ.get("OUT", "/tmp") + "/gpu_span.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); out.write(s + "\n"); out.flush()

ck = build_3b_checkpoint("/tmp/ck3b")
system = MmpipeTTFT(ck, "full_and_piecewise")
pipe = system.pipe
mr = pipe.runner
runner = mr.prefiller
dev = runner.device
say("#", torch.cuda.get_device_name())
P = -(-mr.max_model_len // runner.kv.page_size)
SMAX = 8
lens = torch.zeros(SMAX, dtype=torch.int32, device=dev)
qsl = torch.zeros(SMAX + 1, dtype=torch.int32, device=dev)
table = torch.zeros(SMAX, P, dtype=torch.int32, device=dev)
pool = torch.cuda.graph_pool_handle()
graphs = {}

def inputs_for(n):
    from mmpipe.engine.processor import Prepared
    from mmpipe import SamplingParams
    params = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
    prepared = Prepared(0, "bench", make_prompts(ck, 1, n, seed=n)[0], [], params.resolve(pipe.defaults), False)
    req = pipe.processor.assemble(prepared, [])
    req.pages = list(range(1, 2 + n // runner.kv.page_size))
    return PrefillInputs.build([PrefillChunk(req, 0, n)], runner.kv.page_size)

def full_forward(ids, pos, meta, n):
    size = runner.size_for(n)
    runner.lm.embed(ids, out=runner.input_embeds[:n])
    runner.positions[:n].copy_(pos)  # token-major [T, 3]
    runner.slots[:n].copy_(meta.slot_mapping)
    b = meta.num_seqs
    lens[:b].copy_(meta.seq_lens); qsl[:b + 1].copy_(meta.query_start_loc); qsl[b + 1:].fill_(n)
    table[:b, :meta.page_table.shape[1]].copy_(meta.page_table)
    static = AttentionMetadata(is_decode=False, num_tokens=size, slot_mapping=runner.slots[:size], seq_lens=lens,
                               query_start_loc=qsl, page_table=table, seq_lens_host=None, query_lens_host=None,
                               max_query_len=size, max_seq_len=1, seq_len_bound=mr.max_model_len)
    def body():
        with forward_context(ForwardContext(static, runner.kv.layers, runner.lm.attention)):
            return runner.lm(runner.input_embeds[:size], runner.positions[:size].t(), runner.kv.layers, runner.slots[:size])
    if size not in graphs:
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()
        torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            o = body()
        graphs[size] = (g, o)
    g, o = graphs[size]
    g.replay()
    runner.slots[:n].fill_(runner.dummy_slot)
    return o

runner.lm.attention.extend = "triton"
uploader = PackedUploader(dev)
for n in (16, 64, 256):
    inp = inputs_for(n)
    def pw():
        ids, pos, meta, rows, count = inp.upload(uploader)
        h = runner.forward(ids, pos, [], meta, count)
        return h
    def full():
        ids, pos, meta, rows, count = inp.upload(uploader)
        return full_forward(ids, pos, meta, n)
    for name, fn in (("piecewise", pw), ("full", full)):
        for _ in range(5): fn()
        spans, hosts = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # ~10 ms: the host queues everything behind it
            e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
            e0.record(); t = time.perf_counter(); fn(); hosts.append((time.perf_counter() - t) * 1e3); e1.record()
            torch.cuda.synchronize(); spans.append(e0.elapsed_time(e1))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        ks = sum((getattr(e, "device_time", 0) or 0) for e in prof.events() if getattr(e.device_type, "name", "") == "CUDA") / 1e3
        nk = sum(1 for e in prof.events() if getattr(e.device_type, "name", "") == "CUDA")
        say(f"| {n} | {name} | GPU span {statistics.median(spans):.3f} ms | kernel sum {ks:.3f} ms ({nk} activities) | idle {statistics.median(spans) - ks:.3f} | host queue {statistics.median(hosts):.3f} ms |")
    a = pw().clone(); b = full().clone()
    say(f"|   full == piecewise hidden: {torch.equal(a[:n], b[:n])}, max diff {(a[:n].float() - b[:n].float()).abs().max().item():.3g}")

# host costs of uploads
def per(f, reps=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): f()
    r = (time.perf_counter() - t) / reps * 1e6; torch.cuda.synchronize(); return r
a = np.arange(400, dtype=np.int64)
say(f"| to_device(400 int64) {per(lambda: tr.to_device(a, dev)):.1f} us")
pinned = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
pn = pinned.numpy()
dst = torch.empty(1 << 16, dtype=torch.uint8, device=dev)
def staged():
    pn[:3200].view(np.int64)[:] = a
    dst[:3200].copy_(pinned[:3200], non_blocking=True)
say(f"| staged numpy->pinned + copy_ {per(staged):.1f} us")
say(f"| torch.empty cuda {per(lambda: torch.empty(400, dtype=torch.int64, device=dev)):.1f} us")
ev = torch.cuda.Event()
say(f"| event.record {per(lambda: ev.record()):.1f} us  query {per(lambda: ev.query()):.1f} us")
say(f"| pin_memory() {per(lambda: torch.from_numpy(a).pin_memory()):.1f} us")
say(f"| slice+view {per(lambda: dst[:3200].view(torch.int64)):.1f} us")
x = runner.input_embeds
idx = torch.arange(64, device=dev)
say(f"| embed(64) {per(lambda: runner.lm.embed(idx, out=x[:64])):.1f} us")
say(f"| copy_ small d2d {per(lambda: runner.slots[:64].copy_(idx)):.1f} us")
say(f"| fill_ {per(lambda: runner.slots[:64].fill_(0)):.1f} us")
