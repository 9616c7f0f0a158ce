"""Decode ms/step for configurations that differ in quantization and `MMPIPE_*` switches, one
process (the tree is whatever PYTHONPATH points at), a Pipeline per configuration in the order
given. ms/step from differencing two generation lengths (16 and 80 new tokens, best of three
each), prompts of ~20 tokens; batch 1 also as a share of the weight-read floor (LM weight bytes,
an untied input embedding left out, / copy bandwidth).
Usage: python docs/bench/runs/decode_switch_ab.py CKPT BATCHES CONFIG [CONFIG ...]
  BATCHES: comma-separated, e.g. 1,8,32,128
  CONFIG: QUANT[:VAR=VALUE[+VAR=VALUE...]], QUANT bf16 | fp8 | fp8-all,
  e.g. fp8:MMPIPE_DECODE_ROPE_FUSED=0
(Each configuration captures its own decode graphs, so switches read at capture time apply.)
`generate` and `batch_timings` also serve pdl_prefetch_ab.py."""
import os
import sys
import time

import torch

from mmpipe import Pipeline, SamplingParams, settings


def generate(pipe: Pipeline, batch: int, new_tokens: int) -> None:
    prompts = [f"request {i}: hello there " * 4 for i in range(batch)]
    pipe.generate(prompts, sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0),
                  progress=False)


def timed(pipe: Pipeline, batch: int, new_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    generate(pipe, batch, new_tokens)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_ms(pipe: Pipeline, batch: int) -> float:
    """ms per decode step: (best of 3 at 80 new tokens - best of 3 at 16) / 64, after one of each."""
    timed(pipe, batch, 16), timed(pipe, batch, 80)
    return (min(timed(pipe, batch, 80) for _ in range(3)) - min(timed(pipe, batch, 16) for _ in range(3))) / 64 * 1e3


def weight_floor_ms(pipe: Pipeline, bandwidth: float) -> float:
    """LM weight bytes (an untied input embedding is gathered, B rows a step, not read whole) /
    copy bandwidth (bytes/s), in ms."""
    lm = pipe.model.language
    weight_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
    if lm.lm_head is not None:
        weight_bytes -= lm.embed_tokens.weight.numel() * lm.embed_tokens.weight.element_size()
    return weight_bytes / bandwidth * 1e3


def batch_timings(ck: str, quant: str, batches: list[int],
                  bandwidth: float) -> tuple[Pipeline, float, list[float]]:
    """A Pipeline of `quant` (bf16, fp8, fp8-all), its weight floor (ms) and decode ms/step per batch."""
    pipe = Pipeline.from_pretrained(ck, quantization=None if quant == "bf16" else quant, startup_progress=False)
    return pipe, weight_floor_ms(pipe, bandwidth), [decode_ms(pipe, b) for b in batches]


def main() -> None:
    from mmpipe.app.bench.main import copy_bandwidth

    ck, batches, configs = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], sys.argv[3:]
    bw = copy_bandwidth() * 1e9
    print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for config in configs:
        quant, _, switches = config.partition(":")
        saved = {}
        for pair in filter(None, switches.split("+")):
            name, value = pair.split("=")
            saved[name] = os.environ.get(name)
            os.environ[name] = value
        settings.refresh()
        pipe, floor, times = batch_timings(ck, quant, batches, bw)
        row = [f"b{b} {ms:.3f}" + (f" ({floor / ms:.0%} of {floor:.2f})" if b == 1 else "")
               for b, ms in zip(batches, times)]
        print(f"{config:40s} " + " | ".join(row), flush=True)
        pipe.close()
        torch.cuda.empty_cache()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":
    main()
