"""The rows attention kernel (`mmpipe.kernels.rows_attention`) under the Triton interpreter on the
CPU, in float32: each row equal to float64 attention over its own keys, for a block of one
sequence (one page table for all its rows), blocks that straddle two sequences, padding rows
(zeros), GQA groups of 8 and of 6 (padded to 8), one and several splits (skipped where Triton is
not installed; on CUDA, in bfloat16 and in the row graphs, `tests/gpu/test_gpu_attention.py`)."""

from __future__ import annotations

from tests.helpers import run_under_triton_interpreter

_SCRIPT = """
import json
import torch
from mmpipe.kernels.rows_attention import paged_rows_attention
print("READY")
g = torch.Generator().manual_seed(0)
results = []
# (heads, kv_heads, query tokens of each sequence, their cached prefixes, splits, padding rows)
cases = [(16, 2, [40], [300], 4, 0), (16, 2, [5, 9, 3], [200, 90, 150], 3, 0), (12, 2, [20], [130], 1, 4),
         (16, 2, [7, 30], [64, 250], 2, 3)]
page_size, dim = 16, 64
for heads, kv_heads, new, cached, splits, pad in cases:
    pages_total = 200
    k_cache = torch.randn(pages_total, page_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(pages_total, page_size, kv_heads, dim, generator=g)
    order = torch.randperm(pages_total - 1, generator=g) + 1  # page 0: the dummy page
    tables, lens, seqs, used = [], [], [], 0
    width = max(-(-(c + n) // page_size) for c, n in zip(cached, new))
    for s, (n, c) in enumerate(zip(new, cached)):
        count = -(-(c + n) // page_size)
        table = torch.zeros(width, dtype=torch.int32)
        table[:count] = order[used:used + count].to(torch.int32)
        used += count
        for i in range(n):
            tables.append(table)
            lens.append(c + i + 1)
            seqs.append(s)
    rows = len(lens) + pad
    tables += [torch.zeros(width, dtype=torch.int32)] * pad
    lens += [1] * pad
    seqs += [-1] * pad
    table, lens_t, seqs_t = torch.stack(tables), torch.tensor(lens, dtype=torch.int32), torch.tensor(seqs, dtype=torch.int32)
    q = torch.randn(rows, heads, dim, generator=g)
    out = torch.full((rows, heads, dim), float("nan"))
    scale = dim ** -0.5
    paged_rows_attention(q, k_cache, v_cache, table, lens_t, seqs_t, out, scale, splits)
    worst = 0.0
    group = heads // kv_heads
    for r in range(rows - pad):
        t = torch.arange(lens[r])
        pages = table[r].long()[t // page_size]
        k = k_cache[pages, t % page_size].double()  # [len, kv_heads, dim]
        v = v_cache[pages, t % page_size].double()
        for h in range(heads):
            w = torch.softmax((k[:, h // group] @ q[r, h].double()) * scale, 0)
            worst = max(worst, (out[r, h].double() - w @ v[:, h // group]).abs().max().item())
    padding_zero = bool(pad == 0 or out[rows - pad:].eq(0).all())
    results.append([heads, new, splits, worst, padding_zero])
print("RESULTS " + json.dumps(results))
"""


def test_every_row_attends_to_its_own_keys():
    results = run_under_triton_interpreter(_SCRIPT)
    assert len(results) == 4
    for heads, new, splits, worst, padding_zero in results:
        assert worst < 1e-5, (heads, new, splits, worst)
        assert padding_zero, (heads, new, splits)
