"""Second sweep: bigger sum tiles + split-K partials (M=1), swapped-operand dot (W as the MMA's M side)."""
import itertools, json, os, sys
import torch, triton, triton.language as tl
import torch.nn.functional as F
sys.path.insert(0, os.path.dirname(__file__))
from gemv_sweep import SHAPES, timed, dev, dt  # noqa: runs the first sweep's defs only if guarded

@triton.jit
def gemv_sum_split(x_ptr, w_ptr, out_ptr, N, K, K_SPLIT, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    k0 = s * K_SPLIT
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + k0 + rk[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(k0, k0 + K_SPLIT, BLOCK_K):
        km = (k + rk) < K
        x = tl.load(x_ptr + k + rk, mask=km, other=0.0)
        w = tl.load(w_ptrs, mask=nmask[:, None] & km[None, :], other=0.0, eviction_policy="evict_first")
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        w_ptrs += BLOCK_K
    tl.store(out_ptr + s * N + rn, acc, mask=nmask)

@triton.jit
def gemv_swap(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    ks = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K
    k0 = s * ks
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + k0 + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_x + k0 + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k0, tl.minimum(k0 + ks, K), BLOCK_K):
        km = (k + rk) < K
        x = tl.load(x_ptrs, mask=mmask[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=nmask[:, None] & km[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    o = out_ptr + s * M * N + rm[None, :] * stride_o + rn[:, None]
    tl.store(o, acc, mask=mmask[None, :] & nmask[:, None])

results = []
only = sys.argv[1:] or ["qkv", "o", "gate_up", "down"]
for name in only:
    N, K = SHAPES[name]
    nbytes = N * K * 2
    copies = max(1, (600 << 20) // nbytes)
    ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    for M in (1, 4, 8, 16, 32):
        x = torch.randn(M, K, device=dev, dtype=dt)
        out = torch.empty(M, N, device=dev, dtype=dt)
        part = torch.empty(8, M, N, device=dev, dtype=torch.float32)
        ref = F.linear(x.float(), ws[0].float())
        t = timed(lambda c: torch.matmul(x, ws[c].t(), out=out), copies)
        cands = []
        if M == 1:
            for bn, bk, nw, sp in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (1, 2, 4, 8)):
                if bn * bk > 16384 or (sp > 1 and K // sp < bk): continue
                ksplit = triton.cdiv(triton.cdiv(K, sp), bk) * bk
                grid = (triton.cdiv(N, bn), sp)
                fn = lambda c, bn=bn, bk=bk, nw=nw, sp=sp, ks=ksplit, grid=grid: gemv_sum_split[grid](x, ws[c], part, N, K, ks, K, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
                fn(0); torch.cuda.synchronize()
                err = (part[:sp].sum(0)[None] - ref).abs().max().item()
                cands.append((timed(fn, copies), f"sumsplit bn{bn} bk{bk} w{nw} sp{sp}", err))
        bm = max(8, triton.next_power_of_2(M))
        for bn, bk, ns, sp in itertools.product((64, 128), (64, 128, 256), (3, 4, 6), (1, 2, 4)):
            if bn * bk > 16384: continue
            grid = (triton.cdiv(N, bn), sp)
            fn = lambda c, bn=bn, bk=bk, ns=ns, sp=sp, grid=grid: gemv_swap[grid](x, ws[c], part, M, N, K, K, K, N, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=sp, num_warps=4, num_stages=ns)
            try:
                fn(0); torch.cuda.synchronize()
                err = (part[:sp].sum(0) - ref).abs().max().item()
                cands.append((timed(fn, copies), f"swap bm{bm} bn{bn} bk{bk} s{ns} sp{sp}", err))
            except Exception as e:
                print("fail swap", name, M, bn, bk, ns, sp, str(e)[:150], flush=True)
        cands.sort()
        results.append({"shape": name, "M": M, "cublas_us": t, "best": cands[:6]})
        print(f"{name:8s} M={M:3d} cublas {t:7.2f}us {nbytes/t/1e3:5.0f}GB/s | best {cands[0][0]:7.2f}us {nbytes/cands[0][0]/1e3:5.0f}GB/s {cands[0][1]} err {cands[0][2]:.3g}", flush=True)
        for c in cands[1:4]: print("          ", f"{c[0]:7.2f}us {c[1]} err {c[2]:.3g}")
        best_swap = [c for c in cands if c[1].startswith("swap")][:2]
        for c in best_swap: print("      swap", f"{c[0]:7.2f}us {c[1]}")
    del ws
    torch.cuda.empty_cache()
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "gemv_sweep2.json"), "w"), indent=1)
