"""Fused Triton kernels against their PyTorch references (same rounding order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmpipe.kernels import fused

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 1280), (257, 1280), (33, 2048), (5, 80)])
def test_add_rms_norm(dtype, rows, cols):
    x, d = (torch.randn(rows, cols, device=CUDA).to(dtype) for _ in range(2))
    w = torch.randn(cols, device=CUDA).to(dtype)
    residual, normed = fused.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(residual, x + d)
    torch.testing.assert_close(normed, fused.rms_norm_reference(x + d, w, 1e-6))
    _, alone = fused.add_rms_norm(x, None, w, 1e-6)
    torch.testing.assert_close(alone, fused.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,dim", [(1, 16, 80), (300, 16, 80), (17, 4, 64), (9, 7, 128)])
def test_rotary_qk(dtype, n, heads, dim):
    qkv = torch.randn(n, 3 * heads * dim, device=CUDA).to(dtype)
    half = torch.randn(n, dim // 2, device=CUDA)
    cos, sin = torch.cat([half.cos()] * 2, -1), torch.cat([half.sin()] * 2, -1)
    q, k, v = fused.rotary_qk(qkv, cos, sin, heads)
    q2, k2, v2 = fused.rotary_qk_reference(qkv, cos, sin, heads)
    torch.testing.assert_close(q, q2)
    torch.testing.assert_close(k, k2)
    assert torch.equal(v, v2) and q.is_contiguous() and k.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 3420), (257, 3420), (4, 100)])
def test_silu_mul(dtype, rows, cols):
    g = torch.randn(rows, 2 * cols, device=CUDA).to(dtype) * 3
    gate, up = g.chunk(2, -1)
    torch.testing.assert_close(fused.silu_mul(g), F.silu(gate) * up)


@pytest.mark.parametrize("grids", [[(1, 16, 16)], [(1, 8, 12), (1, 4, 6), (1, 46, 30)]])
def test_vit_rotary_tables(grids):
    import numpy as np
    from mmpipe.vision.metadata import build_pack_meta

    from mmpipe.kernels import vision_rotary as rotary

    meta = build_pack_meta(grids, 2, 112, 14)
    positions = torch.from_numpy(np.ascontiguousarray(meta.positions))
    order = torch.from_numpy(meta.patch_order)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 40, 2, dtype=torch.float) / 40))
    cos_ref, sin_ref = rotary.rotary_tables(positions, order, inv_freq)  # CPU: the PyTorch path
    cos, sin = rotary.rotary_tables(positions.to(CUDA), order.to(CUDA), inv_freq.to(CUDA))
    torch.testing.assert_close(cos.cpu(), cos_ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(sin.cpu(), sin_ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_rows_kernel_equals_the_separate_operations(dtype):
    """The prefill's fixed rows filled by one kernel, bit for bit as the gather, copies and fill;
    two steps of different lengths at one size share one compiled launch (T is read on the
    device), and the shorter step's padding gets the dummy slot over the longer one's slots."""
    from mmpipe.graphs.transfer import PackedUploader
    from mmpipe.kernels.launch import launch
    from mmpipe.kernels.stage_rows import stage_rows, stage_rows_reference

    hidden, size, dummy = 2048, 64, 0
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(1000, hidden, generator=gen).to(dtype).to(CUDA)
    bufs = [torch.full((96, hidden), -7.0, dtype=dtype, device=CUDA), torch.full((96, 3), -5, device=CUDA),
            torch.full((96,), -3, device=CUDA)]
    want = [b.clone() for b in bufs]
    uploader = PackedUploader(CUDA)
    for n in (60, 37):
        before = launch.direct_launches
        ids = torch.randint(0, 1000, (n,), generator=gen).numpy()
        pos_rows = torch.randint(0, 5000, (n, 3), generator=gen).numpy()
        slots = torch.randint(1, 9000, (n,), generator=gen).numpy()
        d_ids, d_pos, d_slots, count = uploader.upload([ids, pos_rows, slots, np.array([n], dtype=np.int64)])
        stage_rows(table, d_ids, d_pos, d_slots, count, *bufs, size, dummy)
        stage_rows_reference(table, d_ids, d_pos, d_slots, *want, size, dummy)
        assert all(torch.equal(a, b) for a, b in zip(bufs, want)), n
    assert (bufs[2][37:64] == dummy).all() and (bufs[2][64:] == -3).all()
    assert launch.direct_launches == before + 1  # the second step reused the first one's compiled launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 1152), (784, 1152), (333, 1280), (64, 4608)])
def test_add_layer_norm(dtype, rows, cols):
    """The fused residual add + LayerNorm of the LayerNorm vision blocks against PyTorch's ops
    (sum rounded to the dtype, then F.layer_norm): bfloat16 within one rounding, float32 close."""
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = (torch.randn(rows, cols, generator=gen, device="cuda") * 3 + 1).to(dtype)
    d = torch.randn(rows, cols, generator=gen, device="cuda").to(dtype)
    w = (1 + 0.2 * torch.randn(cols, generator=gen, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(cols, generator=gen, device="cuda")).to(dtype)
    residual, normed = fused.add_layer_norm(x, d, w, b, 1e-6)
    expected = x + d
    assert torch.equal(residual, expected)
    reference = F.layer_norm(expected, (cols,), w, b, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(normed, reference, rtol=tol, atol=tol)
    same, normed_only = fused.add_layer_norm(x, None, w, b, 1e-6)
    assert same is x or torch.equal(same, x)
    torch.testing.assert_close(normed_only, F.layer_norm(x, (cols,), w, b, 1e-6), rtol=tol, atol=tol)
