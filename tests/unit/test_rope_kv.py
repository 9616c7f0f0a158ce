"""The fused q/k rotary + KV-cache write (`mmpipe/kernels/rope_kv.py`) on the CPU.

The reference must give exactly the bits of the unfused model code (split, `x * cos +
rotate_half(x) * sin` in the model dtype, `index_copy_` into the cache) and of transformers.
The Triton kernel is checked against it on CUDA (tests/gpu/test_gpu_attention.py) and, when Triton is
installed, under the Triton interpreter here (in a subprocess, since TRITON_INTERPRET is read when
a kernel is defined).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from mmpipe.kernels.fused import rotate_half
from mmpipe.kernels.rope_kv import rope_qk_write_kv, rope_qk_write_kv_reference
from tests.helpers import run_under_triton_interpreter

SHAPES = [(16, 2, 128), (4, 4, 64), (7, 1, 80)]  # (heads, kv_heads, head_dim); the first is the 3B shape


def rope_tables(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim] as the model builds them (duplicated halves, float32 math, then the dtype)."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_inputs(rows, heads, kv_heads, dim, dtype, page_size=16, seed=0, random_tables=False):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(dtype)
    if random_tables:  # arbitrary values in every column (the halves differ): catches half mix-ups
        cos = torch.randn(rows, dim, generator=gen).to(dtype)
        sin = torch.randn(rows, dim, generator=gen).to(dtype)
    else:
        cos, sin = rope_tables(torch.randint(0, 32768, (rows,), generator=gen), dim, dtype)
    pages = rows // page_size + 4
    k_cache = torch.randn(pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pages, page_size, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.randperm((pages - 1) * page_size, generator=gen)[:rows] + page_size  # page 0: the dummy page
    return qkv, cos, sin, k_cache, v_cache, slots


def unfused(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, dim):
    """The model code before fusion: Qwen2Attention's split + rotary, then the backend's write_kv."""
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(n, heads, dim)
    k = k.view(n, kv_heads, dim)
    v = v.view(n, kv_heads, dim).contiguous()
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slots, v)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("random_tables", [False, True])
def test_reference_equals_unfused_bit_for_bit(dtype, heads, kv_heads, dim, random_tables):
    inputs = make_inputs(37, heads, kv_heads, dim, dtype, seed=dim + heads, random_tables=random_tables)
    qkv, cos, sin, kc, vc, slots = inputs
    kc2, vc2 = kc.clone(), vc.clone()
    q, k, v = rope_qk_write_kv_reference(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    q2, k2, v2 = unfused(qkv, cos, sin, kc2, vc2, slots, heads, kv_heads, dim)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert q.shape == (37, heads, dim) and k.shape == (37, kv_heads, dim) and v.shape == (37, kv_heads, dim)
    assert q.is_contiguous() and k.is_contiguous()
    assert v.data_ptr() == qkv.data_ptr() + (heads + kv_heads) * dim * qkv.element_size()  # a view of qkv
    # the public entry point runs the reference off CUDA
    qkv4, cos4, sin4, kc4, vc4, slots4 = make_inputs(37, heads, kv_heads, dim, dtype, seed=dim + heads,
                                                     random_tables=random_tables)
    q4, k4, v4 = rope_qk_write_kv(qkv4, cos4, sin4, kc4, vc4, slots4, heads, kv_heads, dim)
    assert torch.equal(q4, q) and torch.equal(k4, k) and torch.equal(v4, v)
    assert torch.equal(kc4, kc) and torch.equal(vc4, vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_transformers(dtype):
    """transformers' Qwen2.5-VL rotary (the numerical oracle) gives the same bits."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    apply = getattr(hf, "apply_rotary_pos_emb", None)  # transformers 5: cos/sin already merged per M-RoPE section
    if apply is None:
        pytest.skip("this transformers version has no plain apply_rotary_pos_emb in Qwen2.5-VL")
    heads, kv_heads, dim = SHAPES[0]
    qkv, cos, sin, kc, vc, slots = make_inputs(29, heads, kv_heads, dim, dtype, seed=5)
    q, k, _ = rope_qk_write_kv_reference(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    n = qkv.shape[0]
    hq, hk, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    hq = hq.view(1, n, heads, dim).transpose(1, 2)  # transformers' [B, H, T, D]
    hk = hk.view(1, n, kv_heads, dim).transpose(1, 2)
    q_hf, k_hf = apply(hq, hk, cos[None], sin[None])
    assert torch.equal(q, q_hf[0].transpose(0, 1)) and torch.equal(k, k_hf[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotates_q_and_k_and_does_not_swap_k_and_v(dtype):
    """Independent of the reference: float64 rotation, and the cache holds rotated k in k_cache
    and the raw v in v_cache."""
    heads, kv_heads, dim = SHAPES[0]
    qkv, cos, sin, kc, vc, slots = make_inputs(19, heads, kv_heads, dim, dtype, seed=7)
    q, k, v = rope_qk_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    n = qkv.shape[0]
    raw_q, raw_k, raw_v = qkv.double().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    raw_q, raw_k, raw_v = raw_q.view(n, heads, dim), raw_k.view(n, kv_heads, dim), raw_v.view(n, kv_heads, dim)
    want_q = raw_q * c + rotate_half(raw_q) * s
    want_k = raw_k * c + rotate_half(raw_k) * s
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(q.double(), want_q, **tol)
    torch.testing.assert_close(k.double(), want_k, **tol)
    assert not torch.allclose(q.double(), raw_q, **tol)  # rotated, not copied
    assert torch.equal(v.double(), raw_v)
    cached_k = kc.view(-1, kv_heads, dim)[slots]
    cached_v = vc.view(-1, kv_heads, dim)[slots]
    assert torch.equal(cached_k, k) and torch.equal(cached_v, v)
    assert not torch.allclose(cached_k.double(), raw_k, **tol)  # the rotated k, not the raw one
    assert not torch.allclose(cached_k.double(), raw_v, **tol)  # and not v


def test_padded_rows_write_only_the_dummy_page():
    heads, kv_heads, dim, page_size = 16, 2, 128, 16
    qkv, cos, sin, kc, vc, slots = make_inputs(12, heads, kv_heads, dim, torch.bfloat16, page_size, seed=11)
    real = 8
    slots[real:] = torch.tensor([0, 1, 0, 5])  # padding rows -> slots of the reserved dummy page 0
    before_k, before_v = kc.clone(), vc.clone()
    _, k, v = rope_qk_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    flat_k, flat_v = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots[:real]], k[:real]) and torch.equal(flat_v[slots[:real]], v[:real])
    changed = ((kc != before_k) | (vc != before_v)).flatten(1).any(1)
    real_pages = set((slots[:real] // page_size).tolist())
    assert set(changed.nonzero().flatten().tolist()) <= real_pages | {0}
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, kv_heads, dim)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, kv_heads, dim)[untouched])


def test_float32_rounding_order_is_observable():
    """An FMA-contracted float32 rotation (one rounding of a*c + round(b*s)) differs from the
    reference on ordinary data, so the bit-for-bit GPU test would catch a contracting kernel."""
    heads, kv_heads, dim = SHAPES[0]
    qkv, cos, sin, kc, vc, slots = make_inputs(64, heads, kv_heads, dim, torch.float32, seed=3)
    q, _, _ = rope_qk_write_kv_reference(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    x = qkv[:, :heads * dim].reshape(-1, heads, dim).double()
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    second = (rotate_half(x) * s).float().double()  # rounded product
    fused = (x * c + second).float()  # a*c exact in float64, then one rounding (up to rare double rounding)
    assert (fused != q).any()


# ---------------------------------------------------------------------------- Triton interpreter

_INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import torch
    import triton.language as tl

    bf16_exact = True
    try:  # the interpreter truncates float32 -> bfloat16; make it round to nearest even, as GPUs do
        from triton.runtime import interpreter as it
        original = it.InterpreterBuilder.cast_impl

        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.uint16)
                return it.TensorHandle(data.numpy(), dst_type.scalar)
            return original(self, src, dst_type)

        it.InterpreterBuilder.cast_impl = cast_impl
    except Exception:
        bf16_exact = False

    from mmpipe.kernels.rope_kv import rope_qk_write_kv_triton
    from mmpipe.kernels.rope_kv import rope_qk_write_kv_reference
    from tests.unit.test_rope_kv import make_inputs

    print("READY", flush=True)  # the interpreter is usable; from here on a failure is the kernel's

    results = []
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if bf16_exact else [])
    for dtype in dtypes:
        for (heads, kv_heads, dim), rows, page_size, random_tables in [((16, 2, 128), 5, 16, False),
                                                                       ((7, 1, 80), 3, 1, True),
                                                                       ((3, 3, 6), 4, 2, True)]:
            qkv, cos, sin, kc, vc, slots = make_inputs(rows, heads, kv_heads, dim, dtype, page_size, seed=rows,
                                                       random_tables=random_tables)
            kc2, vc2 = kc.clone(), vc.clone()
            ref = rope_qk_write_kv_reference(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
            # no_fma=False: plain products (the interpreter has no inline asm; numpy never contracts)
            out = rope_qk_write_kv_triton(qkv, cos, sin, kc2, vc2, slots, heads, kv_heads, dim, no_fma=False)
            same = all(torch.equal(a, b) for a, b in zip(ref, out)) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
            results.append([str(dtype), heads, kv_heads, dim, rows, bool(same)])
    print("RESULTS " + json.dumps({"bf16_exact": bf16_exact, "cases": results}))
""")


def test_triton_kernel_under_interpreter():
    report = run_under_triton_interpreter(_INTERPRETER_SCRIPT)
    failed = [case for case in report["cases"] if not case[-1]]
    assert not failed, failed
