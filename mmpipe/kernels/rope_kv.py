"""The language model's rotary embedding of q and k, fused with the paged KV-cache write.

Per layer the model turns the fused qkv projection into rotated q and k and stores the new k and v
in the paged cache. Written in PyTorch that is ~14 small kernels per layer (split, rotate_half's
slices, negation and concatenation, four products, two sums, two `index_copy_`); in a decode step
near the memory-bandwidth floor each costs its minimum run time. On CUDA with Triton it is one
kernel; elsewhere the PyTorch reference below runs.

Both keep the exact rounding order of the unfused model code and of transformers' Qwen2.5-VL
(`apply_multimodal_rotary_pos_emb`, `apply_rotary_pos_emb` from transformers 5 on, runs in the
model dtype; it is the numerical oracle):
`x * cos + rotate_half(x) * sin` with each product rounded to the dtype, then the sum rounded.

`rope_heads` is the same arithmetic on whole head rows, for the decode attention kernel that
rotates its own queries and new key (`decode_attention.paged_decode_rope`).

The kernel: one program per token (all heads: for the 3B shape 16 q + 2 k + 2 v heads x 128, ~5 KB in and
~7 KB out), which keeps all its loads in flight at once; decode batches of 1-256 rows and prefill
chunks of thousands of rows both give a grid of one program per row.

Its rounding is exactly the reference's: each product is rounded to the dtype, then their sum. The
products are taken in float32 (exact for two bf16 or fp16 values) and rounded to the dtype, and the
float32 sum of two dtype values rounded to the dtype is the correctly rounded sum (float32 has more
than 2p+2 bits), so this equals PyTorch's float-opmath kernels bit for bit. The danger is the
compiler contracting a product and the following add into one FMA (one rounding instead of two or
three). It does, in every dtype: with plain `*`, LLVM narrows bf16/fp16 `round(float(a)*float(b))`
to a native bf16/fp16 multiply (exact, so legal) and then fuses it with the add into `fma.rn.bf16`
(measured in the sm_90 PTX). So every product goes through `mul.rn.f32` in inline PTX, which LLVM
cannot look into and ptxas may not fuse (an explicit rounding modifier forbids contraction); the
kernel's PTX then holds no `fma` at all, whatever Triton's fp-fusion setting.
"""

from __future__ import annotations

import torch

from mmpipe.kernels import pdl, tl, triton
from mmpipe.kernels.fused import rms_norm_reference, rotate_half
from mmpipe.kernels.launch import launch, next_power_of_2
from mmpipe.kernels.pdl import pdl_enter


def rope_qk_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                               head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                               eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rope_qk_write_kv` in plain PyTorch, in the model's rounding order (any device)."""
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(n, num_heads, head_dim)
    k = k.view(n, num_kv_heads, head_dim)
    v = v.view(n, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:  # Qwen3: RMSNorm of every head before the rotation
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    c, s = cos[:n].unsqueeze(1), sin[:n].unsqueeze(1)
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q, k, v


def rope_qk_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2*Hkv) * D] (output of the fused qkv projection, bias included); cos, sin [T, D]
    in qkv's dtype (duplicated-halves layout). Returns q [T, H, D] rotated (contiguous), k [T, Hkv, D]
    rotated (contiguous), v [T, Hkv, D] (a view of qkv), and writes the rotated k and v of row t into
    cache slot slot_mapping[t] (flat slot = page*page_size+offset; caches are [pages, page_size, Hkv,
    D]). slot_mapping has exactly T entries (padded rows point at a reserved dummy page). With
    `q_norm` and `k_norm` ([D] weights, Qwen3's per-head RMSNorm), every q and k head is normalised
    before its rotation, in the same kernel (float32 statistics, rounded to the dtype, then scaled
    by the weight and rounded again: transformers' order).

    Graph-safe: no host sync, output shapes depend only on T. One Triton kernel on CUDA, the
    reference elsewhere; both give the same bits."""
    if triton is not None and qkv.is_cuda:
        return rope_qk_write_kv_triton(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                       head_dim, q_norm, k_norm, eps)
    return rope_qk_write_kv_reference(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                      head_dim, q_norm, k_norm, eps)


if triton is not None:

    @triton.jit
    def _mul(a, b, NO_FMA: tl.constexpr):
        """a * b in float32, rounded on its own (never contracted with a following add)."""
        if NO_FMA:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:  # the interpreter (numpy) has no inline asm and never contracts
            return a * b


    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2, NO_FMA: tl.constexpr):
        """(x1, x2) halves -> (x1*c1 + (-x2)*s1, x2*c2 + x1*s2), each product and sum rounded to x's dtype."""
        dt = x1.dtype
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        p1 = _mul(a, c1, NO_FMA).to(dt)
        p2 = _mul(-b, s1, NO_FMA).to(dt)
        p3 = _mul(b, c2, NO_FMA).to(dt)
        p4 = _mul(a, s2, NO_FMA).to(dt)
        o1 = (p1.to(tl.float32) + p2.to(tl.float32)).to(dt)
        o2 = (p3.to(tl.float32) + p4.to(tl.float32)).to(dt)
        return o1, o2


    @triton.jit
    def _head_norm(x1, x2, w_ptr, j, jmask, eps, DIM: tl.constexpr, HALF: tl.constexpr, NO_FMA: tl.constexpr):
        """RMSNorm of every head (rows of the two halves): float32 statistics, normalised values
        rounded to x's dtype, times the weight, rounded again (the reference's order)."""
        dt = x1.dtype
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / DIM
        r = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=jmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=jmask, other=0.0).to(tl.float32)
        y1 = _mul(w1, (a * r).to(dt).to(tl.float32), NO_FMA).to(dt)
        y2 = _mul(w2, (b * r).to(dt).to(tl.float32), NO_FMA).to(dt)
        return y1, y2


    @triton.jit
    def rope_heads(base, d, dmask, rows_mask, cos_row, sin_row, w_ptr, eps,
                   DIM: tl.constexpr, QK_NORM: tl.constexpr, NO_FMA: tl.constexpr):
        """Rotated heads [R, D_PAD] in the dtype, whole rows at once, for a kernel that consumes
        them in that layout (the decode attention): head r's columns are `base[r] + d`. Element d
        takes its rotate-half partner (d + DIM/2 or d - DIM/2) from a second load, so every value
        is `_rotate`'s: the same products, negation and rounding, bit for bit. With QK_NORM each
        head is first RMS-normalised as `_head_norm` does (its float32 sum over the whole row
        at once, not over two halves: the statistic's last bits may differ, Qwen3 only)."""
        half = DIM // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
        mask = rows_mask & dmask
        x = tl.load(base + d, mask=mask, other=0.0)
        xp = tl.load(base + partner, mask=mask, other=0.0)
        dt = x.dtype
        if QK_NORM:
            a, p = x.to(tl.float32), xp.to(tl.float32)
            r = tl.math.rsqrt(tl.sum(a * a, axis=1) / DIM + eps)[:, None]
            w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
            x = _mul(w, (a * r).to(dt).to(tl.float32), NO_FMA).to(dt)
            xp = _mul(wp, (p * r).to(dt).to(tl.float32), NO_FMA).to(dt)
        main = _mul(x.to(tl.float32), cos_row, NO_FMA).to(dt)
        xp = xp.to(tl.float32)
        turned = _mul(tl.where(first, -xp, xp), sin_row, NO_FMA).to(dt)
        return (main.to(tl.float32) + turned.to(tl.float32)).to(dt)


    @triton.jit
    def _rope_qk_write_kv_kernel(
        qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, eps,
        stride_t, stride_c, stride_s, stride_q, stride_k,
        stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr,
        H_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr, D_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, QK_NORM: tl.constexpr, NO_FMA: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, HALF_PAD)[None, :]
        jmask = j < HALF
        c1 = tl.load(cos_ptr + t * stride_c + j, mask=jmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_c + HALF + j, mask=jmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_s + j, mask=jmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_s + HALF + j, mask=jmask, other=0.0).to(tl.float32)
        row = qkv_ptr + t * stride_t

        # q heads [0, HEADS)
        h = tl.arange(0, H_PAD)[:, None]
        mask = (h < HEADS) & jmask
        x1 = tl.load(row + h * DIM + j, mask=mask, other=0.0)
        x2 = tl.load(row + h * DIM + HALF + j, mask=mask, other=0.0)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, qn_ptr, j, jmask, eps, DIM, HALF, NO_FMA)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, NO_FMA)
        tl.store(q_ptr + t * stride_q + h * DIM + j, o1, mask=mask)
        tl.store(q_ptr + t * stride_q + h * DIM + HALF + j, o2, mask=mask)

        # k heads [HEADS, HEADS + KV_HEADS): to the k output and the cache slot
        slot = tl.load(slots_ptr + t).to(tl.int64)
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        g = tl.arange(0, KV_PAD)[:, None]
        mask = (g < KV_HEADS) & jmask
        x1 = tl.load(row + (HEADS + g) * DIM + j, mask=mask, other=0.0)
        x2 = tl.load(row + (HEADS + g) * DIM + HALF + j, mask=mask, other=0.0)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, kn_ptr, j, jmask, eps, DIM, HALF, NO_FMA)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, NO_FMA)
        tl.store(k_ptr + t * stride_k + g * DIM + j, o1, mask=mask)
        tl.store(k_ptr + t * stride_k + g * DIM + HALF + j, o2, mask=mask)
        kc = kc_ptr + page * stride_kcp + offset * stride_kcs + g * stride_kch
        tl.store(kc + j, o1, mask=mask)
        tl.store(kc + HALF + j, o2, mask=mask)

        # v heads [HEADS + KV_HEADS, HEADS + 2 * KV_HEADS): copied to the cache slot as they are
        d = tl.arange(0, D_PAD)[None, :]
        mask = (g < KV_HEADS) & (d < DIM)
        v = tl.load(row + (HEADS + KV_HEADS + g) * DIM + d, mask=mask, other=0.0)
        tl.store(vc_ptr + page * stride_vcp + offset * stride_vcs + g * stride_vch + d, v, mask=mask)


def check_rope_inputs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> bool:
    """The layouts the Triton kernels that rotate a fused qkv assume (here and in
    `decode_attention.paged_decode_rope`), else ValueError; returns whether the heads are normed."""
    n = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)}: expected [T, {width}] with unit column stride")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim}: the rotate-half rotary embedding needs an even head dim")
    if cos.shape[0] < n or sin.shape[0] < n or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos/sin: need [T, head_dim] rows with unit column stride")
    if slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {n} rows")
    for cache in (k_cache, v_cache):
        if cache.shape[2:] != (num_kv_heads, head_dim) or cache.stride(3) != 1:
            raise ValueError(f"cache {tuple(cache.shape)}: expected [pages, page_size, {num_kv_heads}, {head_dim}]"
                             " with unit last stride")
    norm = q_norm is not None and k_norm is not None
    if norm and (q_norm.shape != (head_dim,) or k_norm.shape != (head_dim,)):  # type: ignore[union-attr]
        raise ValueError(f"q_norm / k_norm: expected [{head_dim}] weights")
    return norm


def rope_qk_write_kv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                            head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                            eps: float = 1e-6, no_fma: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel behind `mmpipe.kernels.rope_kv.rope_qk_write_kv` (same arguments and results).
    `no_fma=False` replaces the inline-PTX products with plain ones, for the Triton interpreter
    only (it has no inline asm, and numpy never contracts)."""
    n = qkv.shape[0]
    norm = check_rope_inputs(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                             q_norm, k_norm)
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv.view(n, num_heads + 2 * num_kv_heads, head_dim)[:, num_heads + num_kv_heads:]
    if n:
        half = head_dim // 2
        launch(
            _rope_qk_write_kv_kernel, (n,),
            qkv, cos, sin, slot_mapping, q, k, k_cache, v_cache, q_norm if norm else qkv, k_norm if norm else qkv,
            eps, qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HEADS=num_heads, KV_HEADS=num_kv_heads, DIM=head_dim, HALF=half,
            H_PAD=next_power_of_2(num_heads), KV_PAD=next_power_of_2(num_kv_heads),
            HALF_PAD=next_power_of_2(half), D_PAD=next_power_of_2(head_dim),
            PAGE_SIZE=k_cache.shape[1], QK_NORM=norm, NO_FMA=no_fma, PDL=(on := pdl.enabled(qkv)),
            num_warps=4, launch_pdl=on,
        )
    return q, k, v
