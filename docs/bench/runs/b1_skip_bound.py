"""An upper bound on what fusing away batch 1's short kernels could give: decode ms/step at batch 1
with some of them not launched at all (wrong tokens, same weight reads and attention lengths).
A skipped kernel is one whose grid starts with 1 (a one-row step): add + RMSNorm (`norm`), the
attention's reduce (`reduce`), rotary + KV write (`rope`). Not a mode of the library; a bench
that only this script's monkeypatching creates. (Call 2 ran it on b3ff179. Since 20cfe7a batch 1's
adds run inside the FP8 products: for the same bound run it with MMPIPE_DECODE_NORM_FUSED=0.)
Usage: python docs/bench/runs/b1_skip_bound.py CKPT QUANT SET [SET ...]  SET: none | a+b+..."""
import sys

import torch
from decode_switch_ab import batch_timings
from mmpipe.app.bench.main import copy_bandwidth

from mmpipe.kernels import decode_attention, fused, rope_kv

KERNELS = {"norm": "_add_rms_norm_kernel", "reduce": "_decode_reduce_kernel",
           "rope": "_rope_qk_write_kv_kernel"}
skipped: set[str] = set()


def skipping(launch):
    def wrapper(kernel, grid, *args, **kwargs):
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "")
        if name in skipped and grid[0] == 1:
            return None
        return launch(kernel, grid, *args, **kwargs)
    return wrapper


for module in (decode_attention, fused, rope_kv):
    module.launch = skipping(module.launch)

ck, quant, sets = sys.argv[1], sys.argv[2], sys.argv[3:]
bw = copy_bandwidth() * 1e9
print(torch.cuda.get_device_name(), quant, flush=True)
for chosen in sets:
    skipped.clear()
    skipped.update(KERNELS[k] for k in chosen.split("+") if k != "none")
    pipe, floor, (ms,) = batch_timings(ck, quant, [1], bw)
    print(f"skip {chosen:20s} b1 {ms:.3f} ms/step ({floor / ms:.0%} of {floor:.2f})", flush=True)
    pipe.close()
    torch.cuda.empty_cache()
