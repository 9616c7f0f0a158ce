"""GPU microseconds of the kernels that write FP8 rows with a scale per row at captioning's shapes
(Triton's do_bench_cudagraph, median): the add + RMSNorm (`fp8=0`, and plain), the FP8 SiLU product
(and the plain one), the quantizer. On a tree with `fp8_quant.row_layout`, also the SiLU product
and the quantizer under other layouts (one pass or two, BLOCK, warps; `*` marks the rule's own),
each output checked equal bit for bit to the rule's. Beside them, the time the same bytes would take
at the measured copy rate (a 512 MiB clone; the inputs here may partly sit in the 50 MB L2, so a
kernel can beat it). Usage: python docs/bench/runs/norm_silu_sweep.py"""
import torch
from triton.testing import do_bench_cudagraph

from mmpipe.kernels import fp8_quant, fused

CUDA = torch.device("cuda")
RULE = getattr(fp8_quant, "row_layout", None)


def us(fn):
    return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def bits(out):
    if isinstance(out, tuple) and hasattr(out, "values"):
        return [out.values.view(torch.uint8), out.scale]
    return [t.view(torch.uint8) if t.dtype == fp8_quant.FP8 else t for t in out]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(bits(a), bits(b), strict=True))


def set_rule(rule):
    fp8_quant.row_layout = fused.row_layout = rule


def sweep(line, fn, layouts, per_thread):
    """`fn()` under each layout, against its output under the rule (at `per_thread` values a thread)."""
    if RULE is None:
        return line
    ref = fn()
    for layout in layouts:
        set_rule(lambda cols, values_per_thread=16, layout=layout: layout)
        ok = same(fn(), ref)
        mark = "*" if layout == RULE(cols, per_thread) else ""
        line += (f" | {'one' if layout[0] else 'two'} {layout[1]} {layout[2]}w{mark} "
                 f"{us(fn):6.1f}" + ("" if ok else " DIFFERENT BITS"))
    set_rule(RULE)
    return line


big = torch.empty(1 << 29, dtype=torch.uint8, device=CUDA)
copy_gbps = 2 * big.numel() / us(lambda: big.clone()) / 1e3
del big
print(torch.cuda.get_device_name(), f"copy {copy_gbps:.0f} GB/s (read + write)", flush=True)

for rows, cols, fp8 in [(16384, 1280, 0), (16384, 1280, None), (4096, 2048, 0), (4096, 2048, None),
                        (256, 2048, 0), (16, 2048, 0)]:
    x, d = (torch.randn(rows, cols, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(cols, device=CUDA, dtype=torch.bfloat16)
    at_copy = rows * cols * (2 + 2 + 2 + (1 if fp8 is not None else 2)) / copy_gbps / 1e3
    print(f"norm {rows:5d} x {cols:4d} fp8={fp8}: at copy rate {at_copy:6.1f} us, "
          f"{us(lambda: fused.add_rms_norm(x, d, w, 1e-6, fp8=fp8)):6.1f}", flush=True)

LAYOUTS = {3420: [(True, 4096, 8), (True, 4096, 16), (True, 4096, 32), (False, 4096, 8)],
           11008: [(True, 16384, 8), (True, 16384, 16), (True, 16384, 32), (False, 4096, 8)],
           1280: [(True, 2048, 4), (True, 2048, 8), (True, 2048, 16), (False, 2048, 8)],
           2048: [(True, 2048, 4), (True, 2048, 8), (True, 2048, 16), (False, 2048, 8)]}
for rows, cols in [(16384, 3420), (4096, 3420), (4096, 11008), (256, 11008), (64, 11008)]:
    g = torch.randn(rows, 2 * cols, device=CUDA, dtype=torch.bfloat16) * 3
    at_copy = rows * cols * (2 + 2 + 1) / copy_gbps / 1e3
    fp8_us, plain_us = us(lambda: fused.silu_mul(g, fp8=0)), us(lambda: fused.silu_mul(g))
    line = (f"silu {rows:5d} x {cols:5d}: at copy rate {at_copy:6.1f} us, FP8 {fp8_us:6.1f}, "
            f"plain {plain_us:6.1f}")
    print(sweep(line, lambda: fused.silu_mul(g, fp8=0), LAYOUTS[cols], 8), flush=True)

for rows, cols in [(16384, 1280), (4096, 2048), (64, 2048)]:
    x = torch.randn(rows, cols, device=CUDA, dtype=torch.bfloat16)
    at_copy = rows * cols * 3 / copy_gbps / 1e3
    took = us(lambda: fp8_quant.quantize_per_row(x))
    line = f"quantize_per_row {rows:5d} x {cols:4d}: at copy rate {at_copy:6.1f} us, {took:6.1f}"
    print(sweep(line, lambda: fp8_quant.quantize_per_row(x), LAYOUTS[cols], 16), flush=True)
