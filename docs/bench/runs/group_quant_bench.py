"""The per-group (1 x 128) activation quantizer before (one program per row walking its groups,
one warp; copied here from 16304d1) and now (a program per row and 8 groups), and the SiLU
product with its group quantization fused, at prefill shapes; GPU microseconds per call (CUDA
events over a CUDA graph of 20 calls, best of 5). Usage: python docs/bench/runs/group_quant_bench.py"""
import torch
import triton
import triton.language as tl
from mmpipe.kernels.fp8_quant import FP8, FP8_MAX, INV_FP8_MAX, TINY, quantize_per_group
from mmpipe.kernels.fused import silu_mul


@triton.jit
def _old_kernel(x_ptr, q_ptr, s_ptr, scale_stride, cols, stride_x, tiny, fp8_max, inv_fp8_max, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for group in range(0, tl.cdiv(cols, GROUP)):
        offs = group * GROUP + tl.arange(0, GROUP)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), tiny) * inv_fp8_max
        tl.store(s_ptr + group * scale_stride + row, scale)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + row * cols + offs, q.to(tl.float8e4nv), mask=mask)


def old(x):
    rows, cols = x.shape
    values = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(-(-cols // 128), rows, dtype=torch.float32, device=x.device)
    _old_kernel[(rows,)](x, values, scale, rows, cols, x.stride(0), TINY, FP8_MAX, INV_FP8_MAX, GROUP=128, num_warps=1)
    return values, scale.t()


def us(fn):
    """GPU time per call: 20 calls captured in a CUDA graph (host launch costs out), best of 5 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay(); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / 20)
    return best


print(torch.cuda.get_device_name())
for rows, cols in ((256, 2048), (256, 11008), (1024, 11008), (4096, 2048), (8192, 11008)):
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    a, b = old(x), quantize_per_group(x)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    g = torch.randn(rows, 2 * cols, device="cuda", dtype=torch.bfloat16)
    print(f"{rows} x {cols}: group quantizer old {us(lambda: old(x)):.1f} us, new {us(lambda: quantize_per_group(x)):.1f} us;"
          f" silu_mul + quantizer {us(lambda: quantize_per_group(silu_mul(g))):.1f} us, fused {us(lambda: silu_mul(g, fp8=128)):.1f} us",
          flush=True)
