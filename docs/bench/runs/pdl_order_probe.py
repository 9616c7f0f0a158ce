"""Where the one-row FP8 kernel's first weight load sits relative to PDL's griddepcontrol.wait in
the compiled PTX and SASS, with PREFETCH off and on (issue 31). Usage: python pdl_order_probe.py
(Written for `_row_kernel` before 20cfe7a added its tail arguments: run it on 8f496ab or earlier.)"""
import torch, re
from mmpipe.kernels.gemv import _row_kernel, _swap_kernel
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.randn(2560, 2048, device="cuda").to(torch.float8_e4m3fn)
s = torch.rand(2560, device="cuda")
out = torch.empty(1, 2560, device="cuda", dtype=torch.bfloat16)
for pf in (False, True):
    k = _row_kernel[(640, 1)](x, w, w, s, out, 2560, 2048, 2048, 2048, 0, HAS_BIAS=False, PARTIAL=False, GATED=False, SCALE=1,
                             BLOCK_N=4, BLOCK_K=2048, PDL=True, PREFETCH=pf, num_warps=4, launch_pdl=True)
    ptx = k.asm["ptx"].splitlines()
    marks = [(i, l.strip()) for i, l in enumerate(ptx) if "griddepcontrol" in l or "ld.global" in l]
    print("row PREFETCH", pf, "ptx order:", [m[1][:40] for m in marks][:8])
    try:
        sass = k.asm["sass"].splitlines()
        marks = [l.strip()[:60] for l in sass if re.search(r"LDG|ACQ|DEPBAR|CCTL|griddep|PREEXIT|ACQBULK", l)]
        print("  sass:", marks[:10])
    except Exception as e:
        print("  no sass", e)
