"""The residual add + RMSNorm of one row as a Triton device function, shared by the norm kernel
(`fused.add_rms_norm`) and the last program of a one-row K-split product
(`gemv_kernels._row_kernel`, which adds the product's partial sums to the residual and norms the
sum), so both round alike: bit for bit where they lay the row out alike (the same BLOCK and
warps; the sum of squares is reduced in layout order).
"""

from __future__ import annotations

from mmpipe.kernels import tl, triton

if triton is not None:

    @triton.jit
    def add_rms_norm_row(x_ptr, d_ptr, w_ptr, res_ptr, row, cols, stride_x, stride_d, stride_split, eps,
                         HAS_DELTA: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         SHARED: tl.constexpr):
        """(offsets, mask, w * norm(x + delta)) of `row`, the residual x + delta stored at res_ptr.
        SPLITS > 0: delta is that many float32 partial sums (stride_split apart), added in order and
        rounded once. SHARED: other programs of this kernel wrote them, so they are read from L2
        (`.cg`): an SM's L1 is not kept coherent with the others' writes."""
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            if SPLITS > 0:  # float32 partial sums of a K-split product: add in order, round once
                d_ptrs = d_ptr + row * stride_d + offs
                if SHARED:
                    acc = tl.load(d_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                    for split in tl.static_range(1, SPLITS):
                        acc += tl.load(d_ptrs + split * stride_split, mask=mask, other=0.0,
                                       cache_modifier=".cg")
                else:
                    acc = tl.load(d_ptrs, mask=mask, other=0.0)
                    for split in tl.static_range(1, SPLITS):
                        acc += tl.load(d_ptrs + split * stride_split, mask=mask, other=0.0)
                d = acc.to(x.dtype)
            else:
                d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual, rounded as stored
            tl.store(res_ptr + row * stride_x + offs, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / cols
        normed = (h * tl.math.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        return offs, mask, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
