"""Decode ms/step, FP8 with decode's 33-256-row products on mmpipe's Triton FP8 GEMM (on, the
default) against cuBLASLt (MMPIPE_FP8_TRITON_GEMM=0), and bfloat16; one process, a Pipeline per
configuration, in the order given. ms/step from differencing two generation lengths (16 and 80 new
tokens, best of two each), prompts of ~20 tokens; batch 1 also as a share of the weight-read floor
(LM weight bytes / measured copy bandwidth).
Usage: python docs/bench/runs/fp8_decode_ab.py CKPT [BATCHES] [ORDER]
  BATCHES: comma-separated (default 1,8,32,48,64,96,128,192,256); ORDER: e.g. off,on,bf16"""
# (Each configuration captures its own decode graphs, so the switch read at capture time applies.)
import os, sys, time, torch
from mmpipe import Pipeline, SamplingParams, settings

ck = sys.argv[1]
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8,32,48,64,96,128,192,256").split(",")]
order = (sys.argv[3] if len(sys.argv) > 3 else "off,on,bf16").split(",")
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): y.copy_(x)
torch.cuda.synchronize(); bw = 2 * 10 * (1 << 30) / (time.perf_counter() - t)
del x, y; torch.cuda.empty_cache()
print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
for name in order:
    os.environ["MMPIPE_FP8_TRITON_GEMM"] = "0" if name == "off" else "1"
    settings.refresh()
    pipe = Pipeline.from_pretrained(ck, quantization=None if name == "bf16" else "fp8", startup_progress=False)
    lm = pipe.model.language
    weight_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
    row = []
    for b in batches:
        prompts = [f"request {i}: hello there " * 4 for i in range(b)]

        def run(n):
            torch.cuda.synchronize(); t = time.perf_counter()
            pipe.generate(prompts, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0),
                          progress=False)
            torch.cuda.synchronize(); return time.perf_counter() - t
        run(16); run(80)
        ms = (min(run(80) for _ in range(2)) - min(run(16) for _ in range(2))) / 64 * 1e3
        floor = f" ({weight_bytes / bw * 1e3 / ms:.0%} of the {weight_bytes / bw * 1e3:.2f} ms floor)" if b == 1 else ""
        row.append(f"b{b} {ms:.3f}")
        print(f"{name:5s} decode batch {b:3d}: {ms:.3f} ms/step{floor}", flush=True)
    print(f"{name:5s} " + " | ".join(row), flush=True)
    pipe.close(); torch.cuda.empty_cache()
