"""Where a second process's start-up goes, piece by piece (issue 29): imports, CUDA init, each
part of `load_model`, the tokenizer; then a cProfile of `load_model` on a warm CUDA context.
Usage: python docs/bench/runs/startup_probe.py CHECKPOINT"""
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter()
import mmpipe.pipeline  # noqa: E402,F401

t_mmpipe = time.perf_counter()
print(f"import torch {t_torch - t0:.2f} s, import mmpipe.pipeline {t_mmpipe - t_torch:.2f} s", flush=True)
torch.cuda.init()
torch.empty(1, device="cuda")
torch.cuda.synchronize()
t_cuda = time.perf_counter()
print(f"CUDA init {t_cuda - t_mmpipe:.2f} s", flush=True)

from mmpipe import weights  # noqa: E402
from mmpipe.models import load_model  # noqa: E402
from mmpipe.pipeline import load_tokenizer  # noqa: E402

path = sys.argv[1]
timed: dict[str, float] = {}


def clocked(name, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            timed[name] = timed.get(name, 0.0) + time.perf_counter() - start
    return wrapper


import mmpipe.models as models  # noqa: E402

for name in ("materialize", "load_checkpoint", "prepare_for_kernels", "make_vision_attention", "make_lm_attention",
             "fp8_checkpoint", "spec_for"):
    if hasattr(models, name):
        setattr(models, name, clocked(name, getattr(models, name)))
weights._raw_tensors = clocked("raw reads (generator creation only)", weights._raw_tensors)
for run in range(2):
    timed.clear()
    start = time.perf_counter()
    model = load_model(path, torch.device("cuda"), torch.bfloat16)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    print(f"load_model #{run + 1}: {total:.2f} s; " + ", ".join(f"{k} {v:.2f}" for k, v in timed.items()), flush=True)
    del model
    torch.cuda.empty_cache()
start = time.perf_counter()
tok = load_tokenizer(path)
print(f"tokenizer {time.perf_counter() - start:.2f} s ({type(tok).__name__})", flush=True)
start = time.perf_counter()
n = 0
from safetensors import safe_open  # noqa: E402

for f in weights.checkpoint_files(path):
    with safe_open(f, framework="pt", device="cuda") as handle:
        for name in handle.keys():
            n += handle.get_tensor(name).numel()
torch.cuda.synchronize()
print(f"safe_open(cuda) read alone: {time.perf_counter() - start:.2f} s, {2 * n / 1e9:.2f} GB", flush=True)
import cProfile  # noqa: E402
import pstats  # noqa: E402

profile = cProfile.Profile()
profile.enable()
model = load_model(path, torch.device("cuda"), torch.bfloat16)
torch.cuda.synchronize()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(15)
