"""The Triton FP8 GEMM (mmpipe/kernels/fp8_gemm.py) against cuBLASLt (`torch._scaled_mm`, and
`F.scaled_mm` block-wise) on the 3B shape's FP8 products, per row count, on one GPU.

Each product runs 24 times back to back in a CUDA graph, cycling through enough weight copies
(>= 256 MB) that weights come from memory as in a model; GPU microseconds per call, best of 5
replays. Every Triton result is checked against cuBLASLt's (max |diff| / max |ref|).
With `--all`, every configuration's time for products of <= 256 rows, and the one
`fp8_gemm.rule` picks (marked *).
Usage: python docs/bench/runs/fp8_gemm_sweep.py [lm|lm7b|vit|block|all] [--all]"""
import sys

import torch
import torch.nn.functional as F

from mmpipe.kernels.fp8_gemm import Config, fp8_gemm, rule
from mmpipe.kernels.fp8_quant import quantize_per_group, quantize_per_row

LM = [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 22016, 2048), ("down", 2048, 11008)]
VIT = [("vit qkv", 3840, 1280), ("vit proj", 1280, 1280), ("vit gate_up", 6912, 1280), ("vit down", 1280, 3456)]
LM7B = [("7b qkv", 4608, 3584), ("7b o", 3584, 3584), ("7b gate_up", 37888, 3584), ("7b down", 3584, 18944)]
LM_ROWS = [48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096]
VIT_ROWS = [1024, 4096, 8192, 16384]
BIG = [Config(128, 256, 128, 8, 3), Config(128, 128, 128, 4, 4), Config(128, 128, 128, 8, 4),
       Config(256, 128, 128, 8, 3), Config(128, 256, 64, 8, 4), Config(64, 256, 128, 4, 4),
       Config(128, 128, 64, 4, 5)]
SMALL = [Config(64, 64, 128, 4, 4, 1), Config(64, 128, 128, 4, 4, 1), Config(128, 64, 128, 4, 4, 1),
         Config(64, 64, 256, 4, 3, 1), Config(64, 64, 128, 4, 4, 1, 2), Config(64, 64, 128, 4, 4, 1, 4),
         Config(64, 128, 128, 4, 4, 1, 2), Config(128, 128, 128, 4, 4, 1), Config(128, 128, 128, 8, 4, 1),
         Config(64, 32, 128, 4, 4, 1), Config(64, 32, 256, 4, 3, 1), Config(64, 128, 128, 4, 4, 1, 4),
         Config(64, 64, 256, 4, 3, 1, 2)]
ALL = "--all" in sys.argv
REPS = 24


def graph_time(fn, copies):
    for i in range(2):
        fn(i % copies)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(REPS):
            fn(i % copies)
    g.replay(); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / REPS)
    del g
    return best


def sweep(shapes, rows_list, block):
    torch.manual_seed(0)
    for name, n, k in shapes:
        copies = max(1, -(-(256 << 20) // (n * k)))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        if block:
            nb, kb = -(-n // 128), -(-(-(-k // 128)) // 4) * 4
            ws = (torch.rand(nb, kb, device="cuda") * 0.02 + 0.001)
            full = ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            wq = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            wq, ws = quantize_per_row(w)
        weights = [wq.clone() for _ in range(copies)]
        scales = [ws.clone() for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if block:
                xq, xs = quantize_per_group(x, 128, 4)

                def ref(i):
                    return F.scaled_mm(xq, weights[i].t(), xs, F.ScalingType.BlockWise1x128, scales[i].t(),
                                       F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
            else:
                xq, xs = quantize_per_row(x)

                def ref(i):
                    return torch._scaled_mm(xq, weights[i].t(), scale_a=xs, scale_b=scales[i].view(1, -1),
                                            out_dtype=torch.bfloat16)
            want = ref(0)[:m].float()
            t_ref = graph_time(ref, copies)
            results = []
            chosen = rule(m, n, k, block, split=name.split()[-1] in ("o", "down", "proj"))
            candidates = list(SMALL if m <= 256 else BIG)
            if chosen is not None and chosen not in candidates:
                candidates.append(chosen)
            for cfg in candidates:
                if block and cfg.block_k != 128:
                    continue
                group = 128 if block else 0

                def tri(i, cfg=cfg):
                    return fp8_gemm(xq, xs, weights[i], scales[i], cfg, torch.bfloat16, group=group, rows=m)
                try:
                    got = tri(0)
                    got = got.sums.sum(0) if hasattr(got, "sums") else got.float()
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    t = graph_time(tri, copies)
                except Exception as e:  # a config the compiler or the GPU refuses: report, go on
                    print(f"  {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                results.append((t, cfg, err))
            results.sort(key=lambda r: r[0])
            best = results[0] if results else (float("nan"), None, float("nan"))
            flops = 2 * m * n * k
            print(f"{'block ' if block else ''}{name:12s} N={n:5d} K={k:5d} M={m:5d}: cuBLASLt {t_ref:8.1f} us "
                  f"({flops / t_ref / 1e6:6.0f} TFLOP/s, {n * k / t_ref / 1e3:5.0f} GB/s w) | triton best {best[0]:8.1f} us "
                  f"[{best[1]}] err {best[2]:.1e} ratio {best[0] / t_ref:5.2f} | next: "
                  + ", ".join(f"{r[1]} {r[0]:.1f}" for r in results[1:3]), flush=True)
            if ALL and m <= 256:
                print("    all: " + ", ".join(f"{'*' if r[1] == chosen else ''}{r[1]} {r[0]:.1f}" for r in results)
                      + ("" if chosen is not None else " (rule: cuBLASLt)"), flush=True)
        del weights, scales
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "all"
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if what in ("lm", "all"):
        sweep(LM, LM_ROWS, block=False)
    if what in ("lm7b",):
        sweep(LM7B, [1, 33, 48, 64, 96, 128, 192, 256], block=False)
    if what in ("vit", "all"):
        sweep(VIT, VIT_ROWS, block=False)
    if what in ("block", "all"):
        sweep(LM, [64, 256, 1024, 4096], block=True)
    if what == "precision":  # the rule's choices with each float32 promotion interval (0: Triton's default)
        from mmpipe.kernels import fp8_gemm as module
        SMALL.clear()
        for every in (128, 32, 0):
            module._PRECISE_EVERY = every
            print(f"-- promotion every {every or 'K loop (never)'}", flush=True)
            sweep(LM, [48, 64, 128, 192, 256], block=False)
    if what == "small":  # decode's rows, the 3B and 7B shapes, both scale layouts
        sweep(LM, [33, 48, 64, 96, 128, 192, 256], block=False)
        sweep(LM7B, [48, 64, 128, 256], block=False)
        sweep(LM, [48, 64, 96, 128], block=True)
