"""The kernels of one decode step at batch B: each kernel's mean GPU time per step (profiler,
inside the decode graph), the step's span and the gaps between kernels. With PDL on, a kernel
launched early counts its wait, so run with MMPIPE_PDL=0 for kernel times (and on for the step).
Usage: MMPIPE_PDL=0 python docs/bench/runs/decode_b1_kernels.py CKPT QUANT [B]"""
import collections, json, os, sys, tempfile
import torch
from torch.profiler import ProfilerActivity, profile
from mmpipe import Pipeline, SamplingParams

ck, quant = sys.argv[1], sys.argv[2]
b = int(sys.argv[3]) if len(sys.argv) > 3 else 1
steps = 32
with Pipeline.from_pretrained(ck, device="cuda", dtype="bfloat16", startup_progress=False,
                              quantization=None if quant == "bf16" else quant) as pipe:
    prompts = [f"request {i}: hello there " * 4 for i in range(b)]
    sp = SamplingParams(max_new_tokens=steps, ignore_eos=True, temperature=0.0)
    pipe.generate(prompts, sampling=sp, progress=False)
    layers = pipe.model.language.num_layers
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pipe.generate(prompts, sampling=sp, progress=False)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "t.json"))
        ev = json.load(open(os.path.join(tmp, "t.json")))["traceEvents"]
# Row kernels (the one-row products) are told apart by their grid: qkv, o, gate_up, down, LM head.
ks = sorted((float(e["ts"]), float(e["dur"]),
             e["name"] + (f" grid {e['args'].get('grid')}" if e["name"].startswith("_row_kernel") else ""))
            for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel")
# The decode steps: every kernel from the first decode attention kernel on (the prefill's attention
# is another kernel), over the run's steps - 1 decode steps (the first token comes from the prefill).
first = next(i for i, k in enumerate(ks) if "decode" in k[2])
decode = ks[first:]
per = collections.defaultdict(float)
count = collections.Counter()
gaps = [max(0.0, t1 - (t0 + d0)) for (t0, d0, _), (t1, _, _) in zip(decode, decode[1:])]  # PDL overlaps: 0
for t, d, nm in decode:
    per[nm[:70]] += d
    count[nm[:70]] += 1
spans = [decode[-1][0] + decode[-1][1] - decode[0][0]]
# The steps counted from the trace: one decode attention split launch per layer and step.
m = sum(1 for k in decode if k[2].startswith("_decode_split_kernel")) // layers
if m != steps - 1:
    print(f"note: {m} decode steps in the trace, {steps - 1} expected")
print(f"{torch.cuda.get_device_name()} {quant} batch {b} PDL={os.environ.get('MMPIPE_PDL', '1')}: {m} steps, "
      f"span {spans[0] / m:.1f} us/step, kernels {sum(count.values()) / m:.0f}/step, "
      f"kernel sum {sum(per.values()) / m:.1f} us, gaps {sum(gaps) / m:.1f} us/step")
for nm, d in sorted(per.items(), key=lambda x: -x[1]):
    print(f"  {d / m:8.1f} us/step  {count[nm] / m:5.0f} x {d / count[nm]:6.2f} us  {nm}")
