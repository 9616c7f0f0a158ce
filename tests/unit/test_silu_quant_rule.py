"""When the FP8 SiLU product with a scale per row reads each row once, holding it in registers
(`fused.silu_quant_one_pass`), checked on the CPU against the H100 measurements it encodes
(docs/bench/silu_quant_h100.md): one pass was faster for the ViT's 3420-column rows at any row
count and for decode batches of 11008 columns, slower for prefill's 4096 x 11008."""

from __future__ import annotations

import pytest

from mmpipe.kernels.fused import silu_quant_one_pass


@pytest.mark.parametrize("rows,cols,one", [
    (4096, 3420, True), (16384, 3420, True),  # ViT (Qwen2.5-VL 3B/7B): 57.9 -> 46.4, 220 -> 166 us
    (64, 11008, True), (256, 11008, True),  # 3B decode batches: 8.6 -> 6.2, 11.2 -> 10.0 us
    (4096, 11008, False),  # 3B prefill: 120 -> 133 us in one pass
    (257, 11008, False),  # above a decode batch
    (1024, 18944, False), (8, 18944, False),  # 7B: wider than a row held in registers
])
def test_one_pass_where_it_measured_faster(rows, cols, one):
    assert silu_quant_one_pass(rows, cols) is one

