"""GPU microseconds of greedy sampling from bfloat16 logits (a 151936-token vocabulary, the 3B
shape's): the sampler's argmax of the logits as they come against the argmax of a float32 copy
(what it ran before), Triton's do_bench_cudagraph, median; the chosen tokens checked equal.
Runs on 56f66ca only (the sampler change was reverted: the model hands the sampler float32 logits,
see docs/bench/norm_silu_h200.md). Usage: python docs/bench/runs/greedy_sample_ab.py"""
import torch
from triton.testing import do_bench_cudagraph

from language.sampler import SamplerVariant, sample

print(torch.cuda.get_device_name(), flush=True)
for rows in (1, 8, 64, 214, 256):
    logits = (torch.randn(rows, 151936, device="cuda") * 4).to(torch.bfloat16)
    assert torch.equal(sample(logits, None, SamplerVariant()).tokens, logits.float().argmax(-1))
    new = do_bench_cudagraph(lambda: sample(logits, None, SamplerVariant()), rep=40, return_mode="median") * 1e3
    old = do_bench_cudagraph(lambda: logits.float().argmax(-1), rep=40, return_mode="median") * 1e3
    print(f"{rows:4d} rows: float32 copy + argmax {old:7.1f} us, argmax of bfloat16 {new:7.1f} us", flush=True)
