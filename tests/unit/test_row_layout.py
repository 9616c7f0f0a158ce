"""How a row quantized with one scale per row is laid out (`fp8_quant.row_layout`: the quantizer
at 16 values a thread, the FP8 SiLU product, holding gate and up, at 8), checked on the CPU
against the measurements it encodes (docs/performance.md): one pass, the row in registers, was
faster at every measured shape up to 16384 columns; the 7B's 18944 columns are wider than a row
held in registers."""

from __future__ import annotations

import pytest
import torch

from mmpipe.kernels.fp8_quant import row_layout


@pytest.mark.parametrize("cols,per_thread,layout", [
    (3420, 8, (True, 4096, 16)),  # ViT SiLU: one pass at 8 values a thread beat 16, and two passes
    (11008, 8, (True, 16384, 32)),  # 3B LM SiLU: one pass beat two, at many rows and at few
    (1280, 16, (True, 2048, 4)),  # ViT attention output: 16 values a thread beat 8
    (2048, 16, (True, 2048, 4)),  # 3B LM attention output: 16 values a thread beat 8
    (64, 16, (True, 64, 4)), (16384, 16, (True, 16384, 32)),
    (16385, 16, (False, 4096, 8)), (18944, 8, (False, 4096, 8)),  # 7B: two passes of 4096 columns
])
def test_rows_are_held_in_registers_up_to_16384_columns(cols, per_thread, layout):
    assert row_layout(cols, per_thread) == layout


def test_the_silu_product_launches_at_8_values_a_thread(monkeypatch):
    """The launch the FP8 SiLU product takes on CUDA (the kernel call intercepted, so it runs on the
    CPU): its program holds gate and up, at 8 values a thread (the quantizer takes the default 16)."""
    from mmpipe.kernels import fused

    launches = []
    monkeypatch.setattr(fused, "_use_triton", lambda t: True)
    monkeypatch.setattr(fused, "launch", lambda kernel, grid, *a, **k: launches.append((kernel, grid, k)))
    monkeypatch.setattr(fused, "_silu_mul_quant_kernel", "silu", raising=False)
    fused.silu_mul(torch.randn(5, 2 * 3420), fp8=0)
    [(kernel, grid, kw)] = launches
    assert (kernel, grid, kw["BLOCK"], kw["ONE_PASS"], kw["num_warps"]) == ("silu", (5,), 4096, True, 16)
