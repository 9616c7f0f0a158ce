"""Does programmatic dependent launch (PDL) hide the kernel boundaries of the decode chain?
24 'layers' of qkv/o/gate_up/down one-row products back to back in a CUDA graph, 4 variants."""
import torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents

@triton.jit
def row(x_ptr, w_ptr, out_ptr, N, K, K_SPLIT, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PARTIAL: tl.constexpr, PIPE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    split = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k0 = split * K_SPLIT
    k_end = tl.minimum(k0 + K_SPLIT, K)
    if PDL and EARLY:
        gdc_launch_dependents()
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + k0 + rk[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PIPE:
        w = tl.load(w_ptrs, mask=n_mask[:, None] & ((k0 + rk) < k_end)[None, :], other=0.0, eviction_policy="evict_first")
        if PDL:
            gdc_wait()
        for k in range(k0, k_end, BLOCK_K):
            x = tl.load(x_ptr + k + rk, mask=(k + rk) < k_end, other=0.0)
            w_ptrs += BLOCK_K
            w_next = tl.load(w_ptrs, mask=n_mask[:, None] & ((k + BLOCK_K + rk) < k_end)[None, :], other=0.0, eviction_policy="evict_first")
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            w = w_next
    else:
        if PDL:
            gdc_wait()
        for k in range(k0, k_end, BLOCK_K):
            k_mask = (k + rk) < K
            x = tl.load(x_ptr + k + rk, mask=k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            w_ptrs += BLOCK_K
    if PDL and not EARLY:
        gdc_launch_dependents()
    if PARTIAL:
        tl.store(out_ptr + split * N + rn, acc, mask=n_mask)
    else:
        tl.store(out_ptr + rn, acc.to(tl.bfloat16), mask=n_mask)

dev = "cuda"
L = 24
shapes = [("qkv", 2560, 2048, 1), ("o", 2048, 2048, 1), ("gate_up", 22016, 2048, 1), ("down", 2048, 11008, 4)]
W = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)] for name, n, k, s in shapes}
x = torch.randn(22016, device=dev, dtype=torch.bfloat16)
outs = {name: torch.empty(s * n, device=dev, dtype=torch.float32 if s > 1 else torch.bfloat16) for name, n, k, s in shapes}

def chain(pipe, pdl, early):
    for l in range(L):
        src = x
        for name, n, k, s in shapes:
            bn, bk, nw = (4, 1024, 8) if s == 1 else (8, 512, 4)
            ks = triton.cdiv(triton.cdiv(k, s), bk) * bk
            row[(triton.cdiv(n, bn), s)](src, W[name][l], outs[name], n, k, ks, k, BLOCK_N=bn, BLOCK_K=bk,
                PARTIAL=s > 1, PIPE=pipe, PDL=pdl, EARLY=early, num_warps=nw, launch_pdl=pdl)
            src = outs[name] if s == 1 else x

def timeit(fn):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.synchronize()
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
        best = min(best, e0.elapsed_time(e1) * 1000 / 10 / L)
    return best

ref = None
bytes_per_layer = sum(n * k * 2 for _, n, k, _ in shapes)
for pipe, pdl, early in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, 1)]:
    try:
        us = timeit(lambda: chain(pipe, pdl, early))
        chain(pipe, pdl, early); torch.cuda.synchronize()
        o = outs["down"].clone()
        if ref is None: ref = o
        same = torch.equal(o, ref)
        print(f"pipe={pipe} pdl={pdl} early={early}: {us:7.2f} us/layer ({bytes_per_layer / us / 1e3:.0f} GB/s) same={same}", flush=True)
    except Exception as e:
        print(f"pipe={pipe} pdl={pdl} early={early}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
