"""Sweep the paged decode attention's launch parameters (splits, BLOCK_N, warps, stages) on the 3B
shape (16 q heads, 2 KV heads, D 128, page 16, bf16), 36 layers back to back in a CUDA graph."""
import itertools, sys, torch, triton
from mmpipe.language.attention import triton_decode as td
from mmpipe.runtime.triton_launch import next_power_of_2

dev = "cuda"; L = 36; H, HKV, D, PS = 16, 2, 128, 16
SMS = torch.cuda.get_device_properties(0).multi_processor_count

def setup(b, ctx):
    pages_per = -(-ctx // PS)
    total = b * pages_per + 1
    g = torch.Generator(device=dev).manual_seed(b * 7 + ctx)
    caches = [(torch.randn(total, PS, HKV, D, device=dev, generator=g, dtype=torch.bfloat16),
               torch.randn(total, PS, HKV, D, device=dev, generator=g, dtype=torch.bfloat16)) for _ in range(L)]
    perm = torch.randperm(total - 1, device=dev, generator=g) + 1
    table = perm[: b * pages_per].view(b, pages_per).to(torch.int32).contiguous()
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qs = [torch.randn(b, H, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(L)]
    outs = [torch.empty(b, H, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    return caches, table, lens, qs, outs

def run(caches, table, lens, qs, outs, splits, block_n, warps, stages, rwarps):
    b = qs[0].shape[0]
    direct = splits == 1
    part_out = torch.empty(b, H, splits, D, dtype=torch.float32, device=dev)
    part_lse = torch.empty(b, H, splits, dtype=torch.float32, device=dev)
    def fn():
        for l in range(L):
            q, out = qs[l], outs[l]
            kc, vc = caches[l]
            po, pl = (out, out) if direct else (part_out, part_lse)
            ps = (0, 0, 0, 0, 0) if direct else (po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1))
            td._decode_split_kernel[(b, HKV, splits)](q, kc, vc, table, lens, po, pl, out, D**-0.5 * td._LOG2E,
                q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                table.stride(0), *ps, out.stride(0), out.stride(1), NUM_SPLITS=splits, DIRECT=direct, PAGE_SIZE=PS,
                GROUP=H // HKV, GROUP_PAD=16, HEAD_DIM=D, D_PAD=D, BLOCK_N=block_n, PRECISION="tf32", PDL=False,
                num_warps=warps, num_stages=stages)
            if not direct:
                td._decode_reduce_kernel[(b, H)](po, pl, out, po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
                    pl.stride(1), out.stride(0), out.stride(1), NUM_SPLITS=splits, S_PAD=max(2, next_power_of_2(splits)),
                    HEAD_DIM=D, D_PAD=D, PDL=False, num_warps=rwarps)
    fn(); torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    gr.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        e0.record()
        for _ in range(20): gr.replay()
        e1.record(); torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1000 / 20 / L)
    return best, outs[L - 1].clone()

import os
for b, ctx in [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "1x352,32x352,8x352,32x1024").split(",")]:
    data = setup(b, ctx)
    default = td.decode_num_splits(b, HKV, SMS)
    ref_t, ref = run(*data, default, 64, 4, 2, 4)
    kv_bytes = b * ctx * HKV * D * 2 * 2
    rows = []
    for splits, bn, w, st in itertools.product(sorted({1, 2, 4, 8, 16, 32, 64, default}), (32, 64), (4, 8), (1, 2, 3)):
        try:
            t, o = run(*data, splits, bn, w, st, 4)
        except Exception as e:
            continue
        ok = torch.allclose(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
        rows.append((t, splits, bn, w, st, ok))
    rows.sort()
    print(f"b={b} ctx={ctx}: default splits={default} bn=64 w=4 st=2: {ref_t:.2f} us/layer "
          f"({kv_bytes / ref_t / 1e3:.0f} GB/s)", flush=True)
    for t, s, bn, w, st, ok in rows[:8]:
        print(f"   {t:6.2f} us  splits={s:2d} bn={bn:3d} warps={w} stages={st} ok={ok}", flush=True)
