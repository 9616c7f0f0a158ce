"""`mmpipe bench kernels`: mmpipe's kernels against the library ones beside them, bf16, in one
process: paged decode attention (split-KV) against the copy bandwidth, extend attention (Triton
over pages, FlashAttention varlen, SDPA with a mask), ViT attention over many segments, and the
decode step's projections (cuBLAS against mmpipe's few-row kernels) inside a CUDA graph."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from mmpipe.app.bench.results import table
from mmpipe.app.bench.timing import copy_bandwidth, graph_us_per_call, median_ms


def paged_cache(batch: int, ctx: int, page_size: int, kv_heads: int, dim: int, dtype: torch.dtype):
    pages_per_seq = math.ceil(ctx / page_size)
    num_pages = batch * pages_per_seq + 1
    k = torch.randn(num_pages, page_size, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    table = (torch.randperm(num_pages - 1, device="cuda")[: batch * pages_per_seq] + 1).view(batch, -1).int()
    return k, v, table


def bench_decode(copy_gbs: float, shapes: tuple[int, int, int] = (16, 2, 128)) -> list[list[Any]]:
    from mmpipe.kernels.decode_attention import decode_num_splits, paged_decode

    heads, kv_heads, dim = shapes
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in (1, 32, 128):
        # The split count a decode graph for this batch bucket uses, whatever the lengths.
        splits = decode_num_splits(batch, kv_heads, num_sms)
        for ctx in (512, 4096, 32768):
            k, v, table = paged_cache(batch, ctx, 16, kv_heads, dim, torch.bfloat16)
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            ms = median_ms(lambda: paged_decode(q, k, v, table, lens, out, dim**-0.5, splits))
            kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
            gbs = kv_bytes / ms / 1e6
            rows.append([batch, ctx, splits, round(ms * 1000, 1), round(gbs), f"{100 * gbs / copy_gbs:.0f}%"])
            del k, v
            torch.cuda.empty_cache()
    return rows


def bench_extend() -> list[list[Any]]:
    from mmpipe.language.attention.cuda_backend import CudaLMAttention
    from mmpipe.language.attention.metadata import AttentionMetadata
    from mmpipe.language.attention.torch_backend import TorchLMAttention

    heads, kv_heads, dim, page = 16, 2, 128, 16
    cases = [("8 x 1024 new, no cache", [(0, 1024)] * 8), ("1 x 8192 new, no cache", [(0, 8192)]), ("4 x 512 new after 2048", [(2048, 512)] * 4),
             ("16 x 128 new after 1024", [(1024, 128)] * 16), ("1 x 2048 new after 8192", [(8192, 2048)]),
             ("1 x 8192 new after 24576", [(24576, 8192)])]
    rows = []
    for name, seqs in cases:
        lens = [a + b for a, b in seqs]
        batch = len(seqs)
        k_cache, v_cache, table = paged_cache(batch, max(lens), page, kv_heads, dim, torch.bfloat16)
        q_lens = [b for _, b in seqs]
        total = sum(q_lens)
        slots = torch.cat([table[i].long()[torch.arange(a, a + b, device="cuda") // page] * page
                           + torch.arange(a, a + b, device="cuda") % page for i, (a, b) in enumerate(seqs)])
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(False, total, slots, torch.tensor(lens, dtype=torch.int32, device="cuda"), qsl,
                                 table, lens, q_lens, max(q_lens), max(lens))
        q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        timings = {}
        for label, backend in (("triton (pages)", CudaLMAttention(dim**-0.5, "triton")),
                               ("varlen", CudaLMAttention(dim**-0.5, "varlen")),
                               ("SDPA + mask (reference)", TorchLMAttention(dim**-0.5))):
            timings[label] = median_ms(lambda: backend.forward(q, k, v, meta, out, (k_cache, v_cache)), rep=50)
        flops = sum(4 * b * (a + (b + 1) / 2) * heads * dim for a, b in seqs)
        rows.append([name] + [round(t, 3) for t in timings.values()]
                    + [round(flops / min(timings['triton (pages)'], timings['varlen']) / 1e9, 1)])
        del k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def bench_vit_attention() -> list[list[Any]]:
    import torch.nn.functional as F
    from mmpipe.vision.attention import TorchVisionAttention, VarlenVisionAttention
    from mmpipe.vision.metadata import segments_of

    heads, dim, patches = 16, 80, 1024  # a 448 px image in the 3B ViT
    varlen, flash, batched = VarlenVisionAttention(), VarlenVisionAttention(short_segments=False), TorchVisionAttention()
    rows = []
    for images in (1, 4, 16):
        for kind, lengths in (("full (per image)", [patches] * images), ("window (8x8 patches)", [64] * 16 * images)):
            total = sum(lengths)
            q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            seg = segments_of(lengths, torch.device("cuda"))

            def loop():  # one SDPA call per segment, as transformers' non-flash path does
                start = 0
                for n in lengths:
                    s = slice(start, start + n)
                    F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1))
                    start += n

            t_var = median_ms(lambda: varlen.forward(q, k, v, seg))
            t_flash = median_ms(lambda: flash.forward(q, k, v, seg))
            t_loop = median_ms(loop, rep=50)
            t_batched = median_ms(lambda: batched.forward(q, k, v, seg), rep=50)
            gbs = 4 * q.numel() * q.element_size() / t_var / 1e6  # q, k, v read, out written
            rows.append([images, kind, round(t_var * 1000, 1), round(t_flash * 1000, 1), round(gbs),
                         round(t_loop * 1000, 1), round(t_batched * 1000, 1), f"{t_loop / t_var:.1f}x"])
    return rows


def bench_decode_gemms(copy_gbs: float) -> list[list[Any]]:
    """The 3B decode step's projections through F.linear (cuBLAS) and through mmpipe's few-row
    kernels (`mmpipe.kernels.gemv`, as the model calls them: o and down K-split into partial sums
    at the sizes where it splits), each over 24 distinct weights (as 24 layers: nothing stays in
    L2), inside a CUDA graph: how fast they stream their weights."""
    import torch.nn.functional as F

    from mmpipe.kernels import gemv

    shapes = {"qkv (bias)": (2560, 2048, True, False), "o": (2048, 2048, False, True),
              "gate_up": (22016, 2048, False, False), "down": (2048, 11008, False, True),
              "lm head": (151936, 2048, False, False)}
    rows = []
    for name, (n, k, bias, split) in shapes.items():
        layers = 4 if n > 100000 else 24
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        for m in (1, 8, 32, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_us_per_call([lambda w=w: F.linear(x, w, b) for w in weights])  # noqa: B023
            if split:  # as the model runs them: partial sums, added up by the norm after them
                ours = gemv.linear_split
            elif name == "lm head":  # logits: rounded to bf16, widened to float32 in the kernel
                ours = lambda x, w, b: gemv.linear(x, w, b, out_dtype=torch.float32)  # noqa: E731
            else:
                ours = gemv.linear
            mm_us = graph_us_per_call([lambda w=w: ours(x, w, b) for w in weights]) if m <= gemv.MAX_ROWS else None  # noqa: B023
            best = us if mm_us is None else min(us, mm_us)
            gbs = n * k * 2 / best / 1e3
            rows.append([name, f"{n}x{k}", m, round(us, 2), None if mm_us is None else round(mm_us, 2),
                         "-" if mm_us is None else f"{us / mm_us:.2f}x", round(gbs), f"{100 * gbs / copy_gbs:.0f}%"])
        del weights
        torch.cuda.empty_cache()
    return rows


def _faster(row: list[Any]) -> str:
    return "triton" if row[1] <= row[2] else "varlen"


def run_kernels(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    result = {"device": device, "torch": torch.__version__, "copy_GBps": round(copy_gbs)}
    decode = bench_decode(copy_gbs)
    extend = bench_extend()
    vit = bench_vit_attention()
    gemms = bench_decode_gemms(copy_gbs)
    result.update(decode=decode, extend=extend, vit=vit, gemms=gemms)
    print(f"device {device}, torch {torch.__version__}; device-to-device copy {copy_gbs:.0f} GB/s (read + write)\n")
    print(table("Paged decode (Triton, split-KV), bf16, 16 q heads / 2 kv heads x 128, page 16; eager launches, "
                "so small sizes measure the launch (in-graph step times: `bench decode`)",
                ["batch", "context", "splits", "us", "KV GB/s", "of copy"], decode))
    print(table("Extend attention, bf16, ms (new K/V already in the cache; varlen = FlashAttention on the new "
                "K/V when nothing is cached, else on gathered K/V)",
                ["case", "triton (pages)", "varlen", "SDPA + mask (reference)", "best TFLOP/s"], extend))
    print("faster: " + ", ".join(f"{r[0]}: {_faster(r)}" for r in extend) + "\n")
    print(table("ViT attention, bf16, 16 heads x 80, 1024 patches per image, us",
                ["images", "segments", "mmpipe (varlen; windows: short-segment kernel)", "FlashAttention varlen",
                 "mmpipe GB/s", "per-segment SDPA loop", "batched SDPA (reference)", "loop / mmpipe"], vit))
    print(table("Decode projections, bf16, in a CUDA graph over 24 distinct weights: cuBLAS (F.linear) and "
                "mmpipe's few-row kernels (up to 32 rows; what the model runs: o and down as K-split partial sums, "
                "which the norm after them adds up; the LM head with float32 logits)",
                ["projection", "N x K", "rows", "cuBLAS us", "mmpipe us", "cuBLAS / mmpipe", "weight GB/s (faster)",
                 "of copy"], gemms))
    return result
