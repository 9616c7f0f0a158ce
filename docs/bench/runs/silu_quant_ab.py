"""(Runs on trees up to f933188: 6262030 replaced fused.ONE_PASS_COLUMNS by fp8_quant.row_layout;
norm_silu_sweep.py sweeps the layouts since.)
The FP8 SiLU product with a per-row scale in one pass (the row held in registers) against two
passes (ONE_PASS_COLUMNS = 0): GPU microseconds per call at captioning's shapes (Triton's
do_bench_cudagraph, median), with the plain SiLU product beside them and the two outputs
checked equal bit for bit; then captioning throughput with each (one process, a Pipeline per
configuration, as fp8_caption_ab.py measures).
Usage: python docs/bench/runs/silu_quant_ab.py [CKPT N CONFIGS PASSES]
  CONFIGS: comma-separated QUANTIZATION:one|two, e.g. fp8-all:two,fp8-all:one,fp8:two,fp8:one"""
import os
import sys
import tempfile
import time

import torch

from mmpipe import Pipeline, SamplingParams
from mmpipe.app.bench.caption import write_jpegs
from mmpipe.kernels import fused
from mmpipe.pipeline import caption_conversation



def us(fn):
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3

print(torch.cuda.get_device_name(), flush=True)
one_pass = fused.ONE_PASS_COLUMNS
for rows, cols in ((4096, 3420), (16384, 3420), (4096, 11008), (64, 11008), (256, 11008), (1024, 18944)):
    g = torch.randn(rows, 2 * cols, device="cuda", dtype=torch.bfloat16) * 3
    fused.ONE_PASS_COLUMNS = 0
    two = fused.silu_mul(g, fp8=0)
    t_two = us(lambda: fused.silu_mul(g, fp8=0))
    fused.ONE_PASS_COLUMNS = one_pass
    one = fused.silu_mul(g, fp8=0)
    t_one = us(lambda: fused.silu_mul(g, fp8=0))
    same = torch.equal(one.values.view(torch.uint8), two.values.view(torch.uint8)) and torch.equal(one.scale, two.scale)
    print(f"{rows:6d} x {cols:5d}: two passes {t_two:7.1f} us, one pass {t_one:7.1f} us, plain silu_mul "
          f"{us(lambda: fused.silu_mul(g)):7.1f} us; same bits {same}", flush=True)

if len(sys.argv) > 1:
    ck, n, configs, passes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4])
    paths = write_jpegs(os.path.join(tempfile.mkdtemp(), "images"), n)
    convs = [caption_conversation(p, "Describe this image.") for p in paths]
    params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)

    def stream(pipe, count):
        pipe.engine.drain()
        pipe.engine.cache.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        done = sum(1 for _ in pipe.chat_stream(iter(convs[:count]), params))
        torch.cuda.synchronize()
        assert done == count
        return time.perf_counter() - t

    for config in configs:
        quantization, variant = config.split(":")
        fused.ONE_PASS_COLUMNS = one_pass if variant == "one" else 0
        with Pipeline.from_pretrained(ck, device="cuda", dtype="bfloat16", startup_progress=False,
                                      quantization=quantization) as pipe:
            stream(pipe, 64)
            times = [stream(pipe, n) for _ in range(passes)]
        print(f"{config:14s} {n / min(times):6.1f} images/s (passes: {', '.join(f'{n / t:.1f}' for t in times)})",
              flush=True)
