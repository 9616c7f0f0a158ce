"""FP8 with the activation quantization fused into the norms and SiLU products (MMPIPE_FP8_FUSED_QUANT
on, the default) against each FP8 product quantizing its own input (off), and bfloat16; one process,
a Pipeline per configuration, in the order(s) given (`both`: forward then reverse, best of the two;
`forward`: one pass, "best of two" then prints that one pass). 3B shape. Prints
prefill time to first token at 256 / 1024 tokens (metrics), a 32 x 256-token prefill, decode
ms/step at batch 128 (more rows than the few-row kernels take: its products quantize too), and,
with fp8-all, one image through the ViT at 448 and 896 px.
Usage: python docs/bench/runs/fp8_fused_ab.py CKPT [forward|reverse|both] [BLOCK_CKPT]  (the order(s) to run,
both by default; with BLOCK_CKPT, a 128 x 128 block-scaled FP8 checkpoint, only it, fused off and on)"""
import os, sys, time, torch
from mmpipe import Pipeline, SamplingParams, settings
from tests.helpers import random_image

ck = sys.argv[1]
one = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)


def prompt(n):
    return "<|im_start|>user\n" + "a b " * (n // 2 - 8) + "<|im_end|>\n<|im_start|>assistant\n"


def measure(q, fused):
    os.environ["MMPIPE_FP8_FUSED_QUANT"] = "1" if fused else "0"
    settings.refresh()
    out = {}
    if q == "block":
        pipe = Pipeline.from_pretrained(sys.argv[3], startup_progress=False)
    else:
        pipe = Pipeline.from_pretrained(ck, quantization=q, startup_progress=False)
    for n in (256, 1024):
        pipe.generate([prompt(n)], sampling=one, progress=False)
        out[f"ttft_{n}_ms"] = min(pipe.generate([prompt(n)], sampling=one, progress=False)[0]
                                  .metrics.time_to_first_token_s for _ in range(7)) * 1e3
    batch = [prompt(256)] * 32

    def timed(prompts, params):
        torch.cuda.synchronize(); t = time.perf_counter()
        pipe.generate(prompts, sampling=params, progress=False)
        torch.cuda.synchronize(); return time.perf_counter() - t
    timed(batch, one)
    out["prefill_32x256_ms"] = min(timed(batch, one) for _ in range(5)) * 1e3
    b128 = ["hello there " * 8] * 128
    short, long = (SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0) for n in (16, 80))
    timed(b128, short)
    out["decode_b128_ms"] = (min(timed(b128, long) for _ in range(2)) - min(timed(b128, short) for _ in range(2))) / 64 * 1e3
    if q == "fp8-all" or q is None:
        for px in (448, 896):
            image = pipe.processor.load_image(random_image(px, px, seed=px), "probe")
            pipe.runner.encode_images([image])
            times = []
            for _ in range(10):
                torch.cuda.synchronize(); t = time.perf_counter()
                pipe.runner.encode_images([image]); torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[f"vit_{px}_ms"] = min(times) * 1e3
    pipe.close(); torch.cuda.empty_cache()
    return out


configs = [(None, True), ("fp8", False), ("fp8", True), ("fp8-all", False), ("fp8-all", True)]
if len(sys.argv) > 3:
    configs = [("block", False), ("block", True)]
best = {}
which = sys.argv[2] if len(sys.argv) > 2 else "both"
orders = {"forward": [configs], "reverse": [configs[::-1]], "both": [configs, configs[::-1]]}[which]
for order in orders:
    for q, fused in order:
        r = measure(q, fused)
        name = f"{q or 'bf16'}{'' if q is None else (' fused' if fused else ' unfused')}"
        print(name, {k: round(v, 3) for k, v in r.items()}, flush=True)
        best[name] = {k: min(v, best.get(name, {}).get(k, v)) for k, v in r.items()}
print("best of two:")
for name, r in best.items():
    print(f"  {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
