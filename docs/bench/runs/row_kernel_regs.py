"""Registers and spills of the one-row product kernel as compiled for this GPU, with and without
the residual add + norm tail (FP8 weights only): 3B shape, FP8 and bfloat16 weights, o (2048 x 2048)
and the gated down (2048 x 11008). Usage: python docs/bench/runs/row_kernel_regs.py"""
import torch

from mmpipe.kernels import gemv
from mmpipe.kernels.fp8_quant import quantize_per_row
from mmpipe.kernels.fused import add_rms_norm
from mmpipe.kernels.launch import launch

x = torch.randn(1, 2 * 11008, device="cuda").to(torch.bfloat16)
r = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
nw = torch.rand(2048, device="cuda").to(torch.bfloat16)
for n, k, gated in ((2048, 2048, False), (2048, 11008, True)):
    w = (torch.randn(n, k, device="cuda") / 16).to(torch.bfloat16)
    w8, s = quantize_per_row(w)
    xi = x[:, : 2 * k if gated else k].contiguous()
    fp8_split = gemv.fp8_gated_linear_split if gated else gemv.fp8_linear_split
    plain_split = gemv.gated_linear_split if gated else gemv.linear_split
    # (call 5 ran it before deferral became opt-in, when these FP8 products came pending unasked)
    for product in (lambda: fp8_split(xi, w8, s, defer=True), lambda: plain_split(xi, w)):
        add_rms_norm(r, product(), nw, 1e-6)
        plain = product()
        getattr(plain, "sums", None)  # a pending one, launched without the tail
torch.cuda.synchronize()
for key, entry in launch.entries.items():
    if entry.kernel.fn.__name__ == "_row_kernel":
        c = entry.compiled
        print(f"TAIL={entry.tail[entry.kernel.arg_names.index('TAIL') - len(entry.kernel.arg_names)]!s:5} "
              f"SCALE={entry.tail[entry.kernel.arg_names.index('SCALE') - len(entry.kernel.arg_names)]} "
              f"GATED={entry.tail[entry.kernel.arg_names.index('GATED') - len(entry.kernel.arg_names)]!s:5} "
              f"regs {c.n_regs} spills {c.n_spills} shared {c.metadata.shared}")
