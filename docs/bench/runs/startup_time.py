"""Seconds from `import mmpipe` to a Pipeline ready (from_pretrained), one process, with the default
prefill graph schedule or one extended to 8192 tokens in 512-token steps (g8192).
Usage: python docs/bench/runs/startup_time.py CKPT [g8192] [QUANT]
(Since 8e30052 the default schedule is g8192's: the comparison means something on older trees.)"""
import sys, time
t = time.perf_counter()
from mmpipe import Pipeline
from mmpipe.config import GraphConfig
from mmpipe.language.prefill_graphs import STARTUP_PREFILL_SIZES
opts = {}
if len(sys.argv) > 2 and sys.argv[2] == "g8192":
    opts["prefill_graph"] = GraphConfig(buckets=STARTUP_PREFILL_SIZES + tuple(range(2560, 8193, 512)))
q = sys.argv[3] if len(sys.argv) > 3 else "bf16"
pipe = Pipeline.from_pretrained(sys.argv[1], startup_progress=False, quantization=None if q == "bf16" else q, **opts)
st = pipe.stats()["prefill"]
print(f"{sys.argv[2] if len(sys.argv) > 2 else 'default'} {q}: ready in {time.perf_counter() - t:.2f} s, "
      f"prefill graphs {st['graphs']}, capture {st['capture_seconds']:.2f} s, graph memory {st['memory_bytes'] / 2**20:.0f} MiB",
      flush=True)
