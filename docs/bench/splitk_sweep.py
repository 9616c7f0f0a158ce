"""Sweep: swap-AB split-K product with M tiled, for the decode o/down products at 128-256 rows,
against cuBLAS. $OUT/p22.txt"""
import os, itertools, torch, triton, triton.language as tl
import torch.nn.functional as F
OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p22.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()

@triton.jit
def k_swap(x_ptr, w_ptr, out_ptr, M, N, K, K_SPLIT, stride_x, stride_w,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    split = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N; m_mask = rm < M
    k0 = split * K_SPLIT
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + k0 + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_x + k0 + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k0, tl.minimum(k0 + K_SPLIT, K), BLOCK_K):
        k_mask = (k + rk) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K; x_ptrs += BLOCK_K
    mask = n_mask[:, None] & m_mask[None, :]
    tl.store(out_ptr + split * M * N + rm[None, :] * N + rn[:, None], acc, mask=mask)

def timeit(f, reps=40):
    for _ in range(3): f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): f()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record(); g.replay(); e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / reps
dev = torch.device("cuda"); bf = torch.bfloat16
say("#", torch.cuda.get_device_name())
# several weight copies cycled so weights come from memory, as in a decode step
for name, n, k in [("down", 2048, 11008), ("o", 2048, 2048), ("gate_up", 22016, 2048)]:
    ws = [torch.randn(n, k, device=dev, dtype=bf) * 0.02 for _ in range(4)]
    for m in (128, 224, 256):
        x = torch.randn(m, k, device=dev, dtype=bf)
        it = itertools.cycle(ws)
        cub = timeit(lambda: F.linear(x, next(it)))
        ref = F.linear(x.float(), ws[0].float())
        best = []
        for bm, bn, bk, splits, warps, stages in itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4), (4, 8), (3, 4)):
            if bm > 128 and bn > 64: continue
            ksplit = -(-(-(-k // splits)) // bk) * bk
            sp = -(-k // ksplit)
            out = torch.empty(sp, m, n, device=dev, dtype=torch.float32)
            grid = (-(-n // bn), sp, -(-m // bm))
            def run(w=None):
                w = next(it)
                k_swap[grid](x, w, out, m, n, k, ksplit, x.stride(0), w.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             num_warps=warps, num_stages=stages)
            try:
                t = timeit(run)
            except Exception as exc:
                continue
            k_swap[grid](x, ws[0], out, m, n, k, ksplit, x.stride(0), ws[0].stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         num_warps=warps, num_stages=stages)
            err = (out.sum(0) - ref).abs().max().item()
            best.append((t, bm, bn, bk, sp, warps, stages, err))
        best.sort()
        say(f"{name:8s} M={m:4d} cuBLAS {cub:7.2f} us | best Triton " +
            " ; ".join(f"{t:6.2f} us bm{bm} bn{bn} bk{bk} s{sp} w{wp} st{st} err{e:.1e}" for t, bm, bn, bk, sp, wp, st, e in best[:3]))
