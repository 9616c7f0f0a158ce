"""cuBLAS default vs PyTorch TunableOp on the 3B shape's GEMMs (decode at batch 224/256, 64-token
prefill, a 4096-row prefill/ViT chunk). $OUT/p21.txt"""
import os, time, torch
import torch.nn.functional as F
OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p21.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()
say("#", torch.cuda.get_device_name(), torch.__version__)
dev = torch.device("cuda"); bf = torch.bfloat16
W = {"qkv": (2560, 2048, True), "o": (2048, 2048, False), "gate_up": (22016, 2048, False), "down": (2048, 11008, False),
     "vit_qkv": (3840, 1280, True), "vit_gate_up": (6912, 1280, True), "vit_down": (1280, 3456, True)}
weights = {k: (torch.randn(n, kk, device=dev, dtype=bf) * 0.02, torch.randn(n, device=dev, dtype=bf) if b else None)
           for k, (n, kk, b) in W.items()}
cases = [(m, k) for m in (64, 224, 256) for k in ("qkv", "o", "gate_up", "down")] + \
        [(4096, k) for k in ("qkv", "o", "gate_up", "down")] + [(16384, k) for k in ("vit_qkv", "vit_gate_up", "vit_down")]
def timeit(f, reps=50):
    for _ in range(5): f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): f()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record(); g.replay(); e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / reps
inputs = {m: torch.randn(m, 11008, device=dev, dtype=bf) for m in (64, 224, 256, 4096, 16384)}
def fn(m, k):
    w, b = weights[k]; x = inputs[m][:, :w.shape[1]].contiguous()
    return lambda: F.linear(x, w, b)
base = {c: timeit(fn(*c)) for c in cases}
import torch.cuda.tunable as tun
tun.enable(True); tun.tuning_enable(True); tun.set_filename("/tmp/tunable.csv")
t0 = time.perf_counter()
for c in cases:
    f = fn(*c)
    for _ in range(3): f()
torch.cuda.synchronize(); say(f"tuning {len(cases)} shapes: {time.perf_counter() - t0:.1f} s")
tun.tuning_enable(False)
tuned = {c: timeit(fn(*c)) for c in cases}
for c in cases:
    m, k = c; w = weights[k][0]
    fl = 2 * m * w.shape[0] * w.shape[1]; by = w.numel() * 2
    say(f"{m:6d} {k:12s} default {base[c]:8.2f} us  tunable {tuned[c]:8.2f} us  x{base[c]/tuned[c]:5.2f}  "
        f"roofline {max(fl/800e12, by/3.0e12)*1e6:7.2f} us")
say("results:", tun.get_results()[:3] if hasattr(tun, "get_results") else "")
