"""Decode ms/step for configurations that differ in quantization and `MMPIPE_*` switches, one
process (the tree is whatever PYTHONPATH points at), a Pipeline per configuration in the order
given. ms/step from differencing two generation lengths (16 and 80 new tokens, best of three
each), prompts of ~20 tokens; batch 1 also as a share of the weight-read floor (LM weight bytes,
an untied input embedding left out, / copy bandwidth).
Usage: python docs/bench/runs/decode_switch_ab.py CKPT BATCHES CONFIG [CONFIG ...]
  BATCHES: comma-separated, e.g. 1,8,32,128
  CONFIG: QUANT[:VAR=VALUE[+VAR=VALUE...]], QUANT bf16 | fp8 | fp8-all,
  e.g. fp8:MMPIPE_DECODE_ROPE_FUSED=0
(Each configuration captures its own decode graphs, so switches read at capture time apply.)"""
import os
import sys
import time

import torch

from mmpipe import Pipeline, SamplingParams, settings
from mmpipe.app.bench.main import copy_bandwidth

ck, batches, configs = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], sys.argv[3:]
bw = copy_bandwidth() * 1e9
print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)


def timed(pipe: Pipeline, batch: int, new_tokens: int) -> float:
    prompts = [f"request {i}: hello there " * 4 for i in range(batch)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    pipe.generate(prompts, sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0),
                  progress=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


for config in configs:
    quant, _, switches = config.partition(":")
    saved = {}
    for pair in filter(None, switches.split("+")):
        name, value = pair.split("=")
        saved[name] = os.environ.get(name)
        os.environ[name] = value
    settings.refresh()
    pipe = Pipeline.from_pretrained(ck, quantization=None if quant == "bf16" else quant, startup_progress=False)
    lm = pipe.model.language
    weight_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
    if lm.lm_head is not None:  # an untied input embedding is gathered (B rows a step), not read whole
        weight_bytes -= lm.embed_tokens.weight.numel() * lm.embed_tokens.weight.element_size()
    row = []
    for b in batches:
        timed(pipe, b, 16), timed(pipe, b, 80)
        ms = (min(timed(pipe, b, 80) for _ in range(3)) - min(timed(pipe, b, 16) for _ in range(3))) / 64 * 1e3
        floor = weight_bytes / bw * 1e3
        row.append(f"b{b} {ms:.3f}" + (f" ({floor / ms:.0%} of {floor:.2f})" if b == 1 else ""))
    print(f"{config:40s} " + " | ".join(row), flush=True)
    pipe.close()
    torch.cuda.empty_cache()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
