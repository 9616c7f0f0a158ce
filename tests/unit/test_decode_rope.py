"""The decode attention with the rotary embedding and KV write inside it (`paged_decode_rope`)
against the two kernels it replaces (`rope_qk_write_kv`, then `paged_decode`): the same output
and cache bits. Here under the Triton interpreter (in a subprocess: TRITON_INTERPRET is read when
a kernel is defined); on CUDA in tests/gpu/test_gpu_attention.py, with the same `fused_and_unfused`.
The interpreter runs programs one after another, and a GPU race may not show, so the order of the
writer's store and the loop's first K/V load is checked in the compiled sm_90 code (Triton's
compiler, no GPU needed).
"""

from __future__ import annotations

import math
import textwrap

import torch

from mmpipe.kernels import triton

from tests.helpers import run_under_triton_interpreter


def fused_and_unfused(lens, heads, kv_heads, dim, dtype, page_size, splits, device, seed, qk_norm=False,
                      no_fma=True):
    """One decode step of rows with KV lengths `lens` (the new token included; 0: a padding row,
    whose slot is the dummy page 0) through both paths, from the same inputs. Returns
    (out, k_cache, v_cache) of the fused path and of the unfused one."""
    from mmpipe.kernels.decode_attention import paged_decode, paged_decode_rope
    from mmpipe.kernels.rope_kv import rope_qk_write_kv_triton

    gen = torch.Generator(device=device).manual_seed(seed)
    width = max(1, max(math.ceil(n / page_size) for n in lens))
    pages = 1 + len(lens) * width  # page 0: the dummy page
    kc = torch.randn(pages, page_size, kv_heads, dim, generator=gen, device=device).to(dtype)
    vc = torch.randn(pages, page_size, kv_heads, dim, generator=gen, device=device).to(dtype)
    table = (torch.randperm(pages - 1, generator=gen, device=device)[: len(lens) * width] + 1).view(len(lens), width)
    table = table.int().contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    last = (seq_lens.long() - 1).clamp(min=0)
    slots = table.long()[torch.arange(len(lens), device=device), last // page_size] * page_size + last % page_size
    slots = torch.where(seq_lens > 0, slots, last % page_size)  # padding rows: the dummy page
    # NaN where the new K/V go: a split that read its newest position before the store would show it
    kc.view(-1, kv_heads, dim)[slots] = float("nan")
    vc.view(-1, kv_heads, dim)[slots] = float("nan")
    qkv = (torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=gen, device=device) * 2).to(dtype)
    cos = torch.randn(len(lens), dim, generator=gen, device=device).to(dtype)  # every column its own value
    sin = torch.randn(len(lens), dim, generator=gen, device=device).to(dtype)
    norms = (None, None)
    if qk_norm:
        norms = tuple((1 + 0.3 * torch.randn(dim, generator=gen, device=device)).to(dtype) for _ in range(2))
    scale = dim ** -0.5

    kc1, vc1 = kc.clone(), vc.clone()
    out1 = torch.full((len(lens), heads, dim), float("nan"), dtype=dtype, device=device)
    paged_decode_rope(qkv, cos, sin, slots, kc1, vc1, table, seq_lens, out1, scale, splits, heads, *norms, 1e-6,
                      no_fma=no_fma)
    kc2, vc2 = kc.clone(), vc.clone()
    out2 = torch.full_like(out1, float("nan"))
    q, _, _ = rope_qk_write_kv_triton(qkv, cos, sin, kc2, vc2, slots, heads, kv_heads, dim, *norms, 1e-6,
                                      no_fma=no_fma)
    paged_decode(q, kc2, vc2, table, seq_lens, out2, scale, splits)
    return (out1, kc1, vc1), (out2, kc2, vc2)


# Lengths: the new token alone (1), around the 32/64-token key block and the page, a padding row in
# the middle, and one long enough to give every split several blocks.
LENS = [1, 16, 17, 0, 64, 65, 300, 700]
# (heads, kv_heads, dim, page_size): the 3B shape (GQA 8), no GQA, a head dim that is not a power
# of two (the padded columns), one query head per KV head with page size 1.
SHAPES = [(16, 2, 128, 16), (4, 4, 64, 16), (7, 1, 80, 16), (2, 2, 32, 1)]

_SCRIPT = textwrap.dedent(r"""
    import json
    import torch
    from tests.unit.test_decode_rope import LENS, SHAPES, fused_and_unfused

    print("READY", flush=True)
    cases = []
    for dtype in (torch.float32, torch.float16):
        for heads, kv_heads, dim, page_size in SHAPES:
            for splits in (1, 3, 16):
                fused, unfused = fused_and_unfused(LENS, heads, kv_heads, dim, dtype, page_size, splits, "cpu",
                                                   seed=dim + splits, no_fma=False)
                out_same = torch.equal(fused[0], unfused[0])
                # several padding rows write the dummy page in no fixed order: compare the others
                cache_same = all(torch.equal(a[1:], b[1:]) for a, b in zip(fused[1:], unfused[1:]))
                finite = bool(torch.isfinite(fused[0]).all())
                cases.append([str(dtype), heads, kv_heads, dim, splits, out_same, cache_same, finite])
    fused, unfused = fused_and_unfused(LENS, 16, 2, 128, torch.float32, 16, 3, "cpu", seed=5, qk_norm=True,
                                       no_fma=False)
    err = ((fused[0] - unfused[0]).abs().max() / unfused[0].abs().max()).item()
    plain, _ = fused_and_unfused(LENS, 16, 2, 128, torch.float32, 16, 3, "cpu", seed=5, no_fma=False)
    moved = ((plain[0] - fused[0]).abs().max() / fused[0].abs().max()).item()
    print("RESULTS " + json.dumps({"cases": cases, "norm_err": err, "norm_moved": moved}))
""")


def test_fused_equals_rope_then_decode_under_interpreter():
    report = run_under_triton_interpreter(_SCRIPT)
    failed = [case for case in report["cases"] if not all(case[-3:])]
    assert not failed, failed
    assert len(report["cases"]) == 2 * len(SHAPES) * 3
    # Qwen3's head norm: float32 statistics summed in another order, so within float32 rounding
    assert report["norm_err"] <= 1e-5
    assert report["norm_moved"] > 1e-2  # and the norm weights really act


def test_the_backend_fuses_decode_buckets_from_two_rows_unless_switched_off(monkeypatch, switch):
    """`CudaLMAttention.decode_rope` by the bucket (split_rows, as the graph and the eager step
    both see it): one row and non-decode steps keep the two kernels, and so does the switch."""
    import pytest

    pytest.importorskip("triton")
    from mmpipe.language.attention import cuda_backend
    from mmpipe.language.attention.metadata import AttentionMetadata

    calls = []
    monkeypatch.setattr(cuda_backend, "paged_decode_rope", lambda *args: calls.append(args[10]))
    backend = cuda_backend.CudaLMAttention(1.0)
    monkeypatch.setattr(backend, "_sms", lambda device: 132)
    cache = (torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8))

    def fused(rows: int, split_rows: int | None, is_decode: bool = True) -> bool:
        meta = AttentionMetadata(is_decode=is_decode, num_tokens=rows, slot_mapping=torch.zeros(rows, dtype=torch.long),
                                 seq_lens=torch.ones(rows, dtype=torch.int32), query_start_loc=None,
                                 page_table=torch.zeros(rows, 1, dtype=torch.int32), seq_lens_host=None,
                                 query_lens_host=None, max_query_len=1, max_seq_len=None, split_rows=split_rows)
        qkv = torch.zeros(rows, 4 * 8 + 2 * 2 * 8)
        return backend.decode_rope(qkv, qkv, qkv, meta.slot_mapping, meta, torch.zeros(rows, 4, 8), cache, 4,
                                   None, None, 1e-6)

    assert not fused(1, None) and not fused(1, 1)
    assert fused(2, None) and fused(1, 2)  # a lone row in a bucket of 2 (padded) is fused, as its graph
    assert calls == [cuda_backend.decode_num_splits(2, 2, 132)] * 2  # the bucket's split count
    assert not fused(8, 8, is_decode=False)
    switch("decode-rope-fusion", "0")
    assert not fused(8, 8)
    assert len(calls) == 2


def test_compiled_code_orders_the_new_kv_store_before_the_loops_loads():
    """In the sm_90 PTX of the fused kernel, a CTA barrier stands between the writer's K/V stores
    and the first K/V load of the attention loop (an asynchronous copy once pipelined), so the
    split that holds the newest position reads what it stored."""
    import pytest

    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mmpipe.kernels import decode_attention

    kernel = decode_attention._decode_split_kernel
    pointers = {"table_ptr": "*i32", "lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                "slots_ptr": "*i64"}
    constexprs = dict(NUM_SPLITS=4, DIRECT=False, PAGE_SIZE=16, GROUP=8, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128,
                      BLOCK_N=64, PRECISION="tf32", PDL=True, ROPE=True, HEADS=16, KV_HEADS=2, QK_NORM=False,
                      NO_FMA=True)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in ("eps", "scale_log2") else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or name.startswith("stride")}  # as launches specialise them
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, aligned),
                              target=GPUTarget("cuda", 90, 64), options={"num_warps": 4, "num_stages": 2})
    lines = compiled.asm["ptx"].splitlines()
    loop_load = next(i for i, line in enumerate(lines) if "cp.async" in line)
    stores = [i for i, line in enumerate(lines[:loop_load]) if "st.global" in line]
    assert len(stores) == 2  # the new key and value
    assert any("bar.sync" in line or "barrier.sync" in line for line in lines[stores[-1]:loop_load])
