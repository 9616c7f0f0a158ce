"""Sweep the several-row (swap-AB) kernel's tile: BLOCK_N 16/32/64 (wave balance), BLOCK_K, stages.
3B shapes, 8 and 32 rows, weights cycled (24 copies) so they come from HBM, CUDA-graph timed."""
import itertools, torch, triton
import torch.nn.functional as F
from mmpipe.runtime import gemv

dev = "cuda"; dt = torch.bfloat16; C = 24
SHAPES = [("gate_up", 22016, 2048), ("down", 2048, 11008), ("o", 2048, 2048), ("qkv", 2560, 2048)]

def timed(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        e0.record()
        for _ in range(10): g.replay()
        e1.record(); torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1000 / 10 / C)
    return best

for name, n, k in SHAPES:
    ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(C)]
    for m in (8, 32):
        x = torch.randn(m, k, device=dev, dtype=dt)
        splits = gemv._splits(m, n, k)
        ref = F.linear(x.float(), ws[-1].float())
        res = []
        for bn, bk, st, nw in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6), (4,)):
            sp = splits
            if bn != 64:  # same split rule, counted in this tile's programs
                sp = 1
                while triton.cdiv(n, bn) * sp < 256 and sp < 4 and k // (2 * sp) >= 512:
                    sp *= 2
            ks = triton.cdiv(triton.cdiv(k, sp), bk) * bk
            sp = triton.cdiv(k, ks)
            out = torch.empty(sp, m, n, device=dev, dtype=torch.float32) if sp > 1 else torch.empty(m, n, device=dev, dtype=dt)
            def fn(bn=bn, bk=bk, st=st, nw=nw, sp=sp, ks=ks, out=out):
                for c in range(C):
                    gemv._swap_kernel[(triton.cdiv(n, bn), sp)](x, ws[c], ws[c], out, m, n, k, ks, x.stride(0), k,
                        HAS_BIAS=False, PARTIAL=sp > 1, GATED=False, IEEE=False, BLOCK_M=max(8, m), BLOCK_N=bn,
                        BLOCK_K=bk, PDL=False, num_warps=nw, num_stages=st)
            try:
                us = timed(fn)
            except Exception as e:
                continue
            got = out.sum(0) if sp > 1 else out.float()
            err = (got - ref).abs().max().item()
            res.append((us, f"bn{bn} bk{bk} st{st} w{nw} sp{sp}", err))
        res.sort()
        cur = [r for r in res if r[1].startswith("bn64 bk128 st4 w4")]
        gb = n * k * 2 / 1e3
        print(f"{name} M={m}: current {cur[0][0]:.2f} us ({gb / cur[0][0]:.0f} GB/s)" if cur else f"{name} M={m}", flush=True)
        for us, cfg, err in res[:5]:
            print(f"    {us:6.2f} us {gb / us:5.0f} GB/s  {cfg}  err={err:.1e}", flush=True)
