"""Captioning throughput with decode's FP8 products on mmpipe's Triton FP8 GEMM (on) and on
cuBLASLt (off, MMPIPE_FP8_TRITON_GEMM=0), and bfloat16: one process, a Pipeline per configuration,
the way `mmpipe bench caption` measures (chat_stream over N 448 px JPEG files, 64 new tokens,
overlap on, encoder cache cleared, warm-up of 64, best of `passes`).
Usage: python docs/bench/runs/fp8_caption_ab.py CKPT [N] [CONFIGS] [PASSES]
  CONFIGS: comma-separated of bf16, fp8:on, fp8:off, fp8-all:on, fp8-all:off (default: all, in that order);
  fp8:on:128 etc.: the Triton GEMM for at most 128 decode rows (fp8_gemm.MAX_ROWS lowered)"""
import os, sys, tempfile, time, torch
from mmpipe import Pipeline, SamplingParams, settings
from mmpipe.app.bench.caption import write_jpegs
from mmpipe.kernels import fp8_gemm
from mmpipe.pipeline import caption_conversation

ck = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
configs = (sys.argv[3] if len(sys.argv) > 3 else "bf16,fp8:on,fp8:off,fp8-all:on,fp8-all:off").split(",")
passes = int(sys.argv[4]) if len(sys.argv) > 4 else 2
paths = write_jpegs(os.path.join(tempfile.mkdtemp(), "images"), n)
convs = [caption_conversation(p, "Describe this image.") for p in paths]
params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)
print(torch.cuda.get_device_name(), f"{n} files", flush=True)


def stream(pipe, count):
    pipe.engine.drain()
    pipe.engine.cache.clear()
    torch.cuda.synchronize(); t = time.perf_counter()
    done = sum(1 for _ in pipe.chat_stream(iter(convs[:count]), params))
    torch.cuda.synchronize()
    assert done == count
    return time.perf_counter() - t


for config in configs:
    quantization, _, gemm = config.partition(":")
    gemm, _, rows = gemm.partition(":")
    fp8_gemm.MAX_ROWS = int(rows or 256)
    os.environ["MMPIPE_FP8_TRITON_GEMM"] = "0" if gemm == "off" else "1"
    settings.refresh()
    with Pipeline.from_pretrained(ck, device="cuda", dtype="bfloat16", startup_progress=False,
                                  quantization=None if quantization == "bf16" else quantization) as pipe:
        stream(pipe, 64)
        times = [stream(pipe, n) for _ in range(passes)]
        decode = pipe.stats()["runner"]
    print(f"{config:12s} {n / min(times):6.1f} images/s (passes: {', '.join(f'{n / t:.1f}' for t in times)}); "
          f"decode steps {decode.get('decode_steps')}", flush=True)
