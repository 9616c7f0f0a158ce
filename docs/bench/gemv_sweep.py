"""Sweep skinny-GEMM (decode) kernels vs cuBLAS on the 3B LM shapes; weights rotated to defeat L2."""
import itertools, json, os, sys, time
import torch, triton, triton.language as tl
import torch.nn.functional as F

@triton.jit
def gemv_sum(x_ptr, w_ptr, out_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k + rk)
            if EVICT:
                w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
        else:
            km = (k + rk) < K
            x = tl.load(x_ptr + k + rk, mask=km, other=0.0)
            w = tl.load(w_ptrs, mask=nmask[:, None] & km[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        w_ptrs += BLOCK_K
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=nmask)

@triton.jit
def gemv_dot(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_x + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
        else:
            km = (k + rk) < K
            x = tl.load(x_ptrs, mask=mmask[:, None] & km[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=nmask[:, None] & km[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    o = out_ptr + rm[:, None] * stride_o + rn[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008),
          "lm_head": (151936, 2048)}
dev = torch.device("cuda")
dt = torch.bfloat16

def timed(fn, copies, reps=10):
    # capture one pass over all weight copies in a graph (the real decode launches them back to back)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in range(copies): fn(c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(copies): fn(c)
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(3):
        e0.record()
        for _ in range(reps): g.replay()
        e1.record(); torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1000 / (reps * copies))
    del g
    return best

def copy_bw():
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    for _ in range(3): b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10): b.copy_(a)
    e1.record(); torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (e0.elapsed_time(e1) / 1000) / 1e9

if __name__ == "__main__":
    results = []
    bw = copy_bw()
    print(f"{torch.cuda.get_device_name()} triton {triton.__version__} copy {bw:.0f} GB/s", flush=True)
    try:
        import triton.language.extra.cuda as tlc
        print("gdc_wait:", hasattr(tlc, "gdc_wait"), "launch_pdl in run sig:", flush=True)
    except Exception as e:
        print("no extra.cuda", e)
    only = sys.argv[1:] or list(SHAPES)
    for name in only:
        N, K = SHAPES[name]
        nbytes = N * K * 2
        copies = max(1, (600 << 20) // nbytes)
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        for M in (1, 8, 32):
            x = torch.randn(M, K, device=dev, dtype=dt)
            out = torch.empty(M, N, device=dev, dtype=dt)
            ref = F.linear(x.float(), ws[0].float())
            row = {"shape": name, "M": M, "N": N, "K": K}
            t = timed(lambda c: torch.matmul(x, ws[c].t(), out=out), copies)
            row["cublas_us"] = t
            cands = []
            if M == 1:
                for bn, bk, nw, ev in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (0, 1)):
                    if bn * bk > 16384: continue
                    even = K % bk == 0
                    if not even and ev: continue
                    grid = (triton.cdiv(N, bn),)
                    fn = lambda c, bn=bn, bk=bk, nw=nw, ev=ev, even=even: gemv_sum[grid](x, ws[c], out, N, K, K, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, EVICT=ev, num_warps=nw)
                    try:
                        fn(0); torch.cuda.synchronize()
                        err = (out.float() - ref).abs().max().item()
                        cands.append((timed(fn, copies), f"sum bn{bn} bk{bk} w{nw} ev{ev}", err))
                    except Exception as e:
                        print("fail", name, bn, bk, nw, e, flush=True)
            bm = 16 if M <= 16 else 32
            for bn, bk, nw, ns in itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 4, 5)):
                if bn * bk > 16384: continue
                even = K % bk == 0
                grid = (triton.cdiv(N, bn),)
                fn = lambda c, bn=bn, bk=bk, nw=nw, ns=ns, even=even: gemv_dot[grid](x, ws[c], out, M, N, K, K, K, N, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, num_warps=nw, num_stages=ns)
                try:
                    fn(0); torch.cuda.synchronize()
                    err = (out.float() - ref).abs().max().item()
                    cands.append((timed(fn, copies), f"dot bm{bm} bn{bn} bk{bk} w{nw} s{ns}", err))
                except Exception as e:
                    print("fail dot", name, bn, bk, ns, str(e)[:200], flush=True)
            cands.sort()
            row["best"] = cands[:5]
            row["cublas_GBps"] = nbytes / t / 1e3
            row["best_GBps"] = nbytes / cands[0][0] / 1e3
            results.append(row)
            print(f"{name:8s} M={M:3d} cublas {t:8.2f}us {nbytes/t/1e3:6.0f}GB/s | best {cands[0][0]:8.2f}us {nbytes/cands[0][0]/1e3:6.0f}GB/s {cands[0][1]} err {cands[0][2]:.3g}", flush=True)
            for c in cands[1:4]: print("          ", f"{c[0]:8.2f}us {c[1]} err {c[2]:.3g}")
        del ws
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", "/tmp")
    json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": results}, open(os.path.join(out_dir, "gemv_sweep.json"), "w"), indent=1)
