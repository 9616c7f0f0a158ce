"""Sweep the few-row kernels' configs for FP8 weights (per-channel scales) on the 3B decode shapes:
the production kernels (gemv._row_kernel, gemv._swap_kernel) launched with explicit configs, each
over enough distinct weights that nothing stays in L2, replayed in a CUDA graph.
(Written for the kernels' arguments of its own session, before later ones were added, e.g.
PREFETCH and 20cfe7a's tail: run it on the tree it was written for, `git log -- <this file>`.)"""
import itertools, sys, torch
from mmpipe.kernels import gemv, pdl
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2
from mmpipe.app.bench.main import graph_us_per_call

FP8 = torch.float8_e4m3fn
SHAPES = {"qkv": (2560, 2048, True, False, False), "o": (2048, 2048, False, True, False),
          "gate_up": (22016, 2048, False, False, False), "down": (2048, 11008, False, True, True)}
a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for _ in range(3): b.copy_(a)
s.record()
for _ in range(10): b.copy_(a)
e.record(); torch.cuda.synchronize()
bw = 2 * a.numel() * 10 / (s.elapsed_time(e) / 1e3) / 1e9
del a, b
print(torch.cuda.get_device_name(), f"copy {bw:.0f} GB/s", flush=True)


def row_call(x, w, sc, bias, out, splits, gated, bn, bk, warps):
    n, k = w.shape
    k_split = cdiv(cdiv(k, splits), bk) * bk
    on = pdl.enabled(x)
    launch(gemv._row_kernel, (cdiv(n, bn), splits), x, w, bias if bias is not None else w, sc, out, n, k, k_split,
           w.stride(0), 0, HAS_BIAS=bias is not None, PARTIAL=splits > 1, GATED=gated, SCALE=1, BLOCK_N=bn,
           BLOCK_K=bk, PDL=on, num_warps=warps, launch_pdl=on)


def swap_call(x, w, sc, bias, out, splits, gated, bk, stages, warps):
    rows = x.shape[0]
    n, k = w.shape
    k_split = cdiv(cdiv(k, splits), bk) * bk
    on = pdl.enabled(x)
    launch(gemv._swap_kernel, (cdiv(n, 64), splits), x, w, bias if bias is not None else w, sc, out, rows, n, k,
           k_split, x.stride(0), w.stride(0), 0, HAS_BIAS=bias is not None, PARTIAL=splits > 1, GATED=gated, SCALE=1,
           IEEE=False, BLOCK_M=max(8, next_power_of_2(rows)), BLOCK_N=64, BLOCK_K=bk, PDL=on, num_warps=warps,
           num_stages=stages, launch_pdl=on)


only = sys.argv[1:] or list(SHAPES)
for name in only:
    n, k, has_bias, splittable, gated = SHAPES[name]
    layers = max(4, (400 << 20) // (n * k))
    ws = [(torch.randn(n, k, device="cuda") * 0.05).to(FP8) for _ in range(layers)]
    scs = [torch.rand(n, device="cuda") * 0.02 + 0.01 for _ in range(layers)]
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    for rows in (1, 8, 32):
        x = torch.randn(rows, k * (2 if gated else 1), device="cuda", dtype=torch.bfloat16)
        if gated and rows > 1:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            g = False
        else:
            g = gated
        # production paths, as the model calls them
        if splittable:
            if g:
                prod = lambda i: gemv.fp8_gated_linear_split(x, ws[i], scs[i])
                prod_bf = lambda i: gemv.gated_linear_split(x, wb[i])
            else:
                prod = lambda i: gemv.fp8_linear_split(x, ws[i], scs[i])
                prod_bf = lambda i: gemv.linear_split(x, wb[i])
        else:
            prod = lambda i: gemv.fp8_linear(x, ws[i], scs[i], bias)
            prod_bf = lambda i: gemv.linear(x, wb[i], bias)
        now = graph_us_per_call([lambda i=i: prod(i) for i in range(layers)])
        now_bf = graph_us_per_call([lambda i=i: prod_bf(i) for i in range(layers)])
        ref = (x[:, :k] if not g else None)
        want = None
        cands = []
        split_opts = (1, 2, 4, 8) if splittable else (1,)
        if rows == 1:
            grid = itertools.product((4, 8, 16, 32), (512, 1024, 2048, 4096), (4, 8), split_opts)
        else:
            grid = itertools.product((128, 256), (3, 4, 5), (4, 8), split_opts)
        for cfg in grid:
            splits = cfg[-1]
            if rows == 1 and (cfg[0] * cfg[1] > 32768 or cfg[1] > next_power_of_2(k)):
                continue
            if splits > 1 and k // splits < 512:
                continue
            bk = cfg[1] if rows == 1 else cfg[0]
            sp = cdiv(k, cdiv(cdiv(k, splits), bk) * bk)
            if sp != splits:
                continue
            out = torch.empty(*((splits,) if splits > 1 else ()), rows, n, device="cuda",
                              dtype=torch.float32 if splits > 1 else torch.bfloat16)
            if rows == 1:
                call = lambda i, cfg=cfg, out=out: row_call(x, ws[i], scs[i], bias if splits == 1 else None, out, cfg[3], g, cfg[0], cfg[1], cfg[2])
            else:
                call = lambda i, cfg=cfg, out=out: swap_call(x, ws[i], scs[i], bias if splits == 1 else None, out, cfg[3], g, cfg[0], cfg[1], cfg[2])
            try:
                call(0); torch.cuda.synchronize()
                res = out.sum(0) if splits > 1 else out.float()
                if want is None:
                    want = prod(0)
                    want = want.sums.sum(0) if isinstance(want, gemv.PartialSums) else want.float()
                    if bias is not None and splits > 1:
                        pass
                err = ((res - (want - (bias.float() if (bias is not None and splits > 1) else 0))).abs().max() /
                       want.abs().max()).item()
                cands.append((graph_us_per_call([lambda i=i, c=call: c(i) for i in range(layers)]), cfg, err))
            except Exception as exc:
                print("fail", name, rows, cfg, str(exc)[:120], flush=True)
        cands.sort(key=lambda c: c[0])
        fp8_bytes = n * k
        print(f"{name:8s} rows {rows:2d}: bf16 now {now_bf:7.2f} us ({2 * fp8_bytes / now_bf / 1e3:5.0f} GB/s) | fp8 now "
              f"{now:7.2f} us ({fp8_bytes / now / 1e3:5.0f} GB/s) | best {cands[0][0]:7.2f} us "
              f"({fp8_bytes / cands[0][0] / 1e3:5.0f} GB/s, {100 * fp8_bytes / cands[0][0] / 1e3 / bw:.0f}% of copy) "
              f"{cands[0][1]} err {cands[0][2]:.2g}", flush=True)
        for c in cands[1:6]:
            print(f"{'':30s}{c[0]:7.2f} us {c[1]} err {c[2]:.2g}")
    del ws, wb
    torch.cuda.empty_cache()
