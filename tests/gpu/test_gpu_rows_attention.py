"""The rows attention kernel on the GPU (`mmpipe.kernels.rows_attention`): an extend step's
tokens over long cached contexts, each row equal to the float64 reference over its own keys, in
float32 (1e-5 relative) and bfloat16 (1e-2), for blocks of one sequence and blocks that straddle
several, padding rows written as zeros, any split count; and captured once in a CUDA graph,
replayed for new lengths, page tables and sequences."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
try:
    from mmpipe.kernels.rows_attention import paged_rows_attention, rows_num_splits
except ImportError:  # a PyTorch build without Triton (CUDA builds have it)
    pytest.skip("needs Triton", allow_module_level=True)
from tests.attention_helpers import rel
from tests.gpu.test_gpu_attention import decode_reference, poison_allocator

CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def step_rows(steps, page_size, width, pages, gen):
    """(table [n, width], lens [n], seqs [n]) of an extend step: `steps` = [(cached, new)] per
    sequence, each sequence's pages drawn at random."""
    order = torch.randperm(pages - 1, generator=gen, device=CUDA) + 1
    tables, lens, seqs, used = [], [], [], 0
    for s, (cached, new) in enumerate(steps):
        table = order[used:used + width].int()
        used += width
        for i in range(new):
            tables.append(table)
            lens.append(cached + i + 1)
            seqs.append(s)
    return (torch.stack(tables), torch.tensor(lens, dtype=torch.int32, device=CUDA),
            torch.tensor(seqs, dtype=torch.int32, device=CUDA))


def caches(pages, page_size, kv_heads, dim, dtype, gen):
    return [torch.randn(pages, page_size, kv_heads, dim, generator=gen, device=CUDA).to(dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 2, 128), (28, 4, 128), (12, 2, 80)])
@pytest.mark.parametrize("splits", [1, 16])
def test_each_row_attends_to_its_own_keys(dtype, heads, kv_heads, dim, splits):
    gen = torch.Generator(device=CUDA).manual_seed(heads + splits)
    page_size, width, pages = 16, 260, 2000
    steps = [(1456, 45), (17, 3), (4000, 13), (333, 1), (700, 20)]
    table, lens, seqs = step_rows(steps, page_size, width, pages, gen)
    pad = 5
    table = torch.cat([table, torch.zeros(pad, width, dtype=torch.int32, device=CUDA)])
    lens = torch.cat([lens, torch.ones(pad, dtype=torch.int32, device=CUDA)])
    seqs = torch.cat([seqs, torch.full((pad,), -1, dtype=torch.int32, device=CUDA)])
    kc, vc = caches(pages, page_size, kv_heads, dim, dtype, gen)
    q = torch.randn(lens.shape[0], heads, dim, generator=gen, device=CUDA).to(dtype)
    poison_allocator()
    out = torch.full_like(q, float("nan"))
    paged_rows_attention(q, kc, vc, table, lens, seqs, out, dim ** -0.5, splits)
    real = lens.shape[0] - pad
    ref = decode_reference(q[:real], kc, vc, table[:real], lens[:real].tolist(), dim ** -0.5)
    assert rel(out[:real], ref) <= TOL[dtype]
    assert out[real:].eq(0).all()  # padding rows


def test_a_captured_step_replays_for_new_lengths_tables_and_sequences():
    gen = torch.Generator(device=CUDA).manual_seed(7)
    heads, kv_heads, dim, page_size, width, pages, rows = 16, 2, 128, 16, 300, 3000, 48
    kc, vc = caches(pages, page_size, kv_heads, dim, torch.bfloat16, gen)
    q = torch.randn(rows, heads, dim, generator=gen, device=CUDA).to(torch.bfloat16)
    table = torch.zeros(rows, width, dtype=torch.int32, device=CUDA)
    lens = torch.ones(rows, dtype=torch.int32, device=CUDA)
    seqs = torch.full((rows,), -1, dtype=torch.int32, device=CUDA)
    out = torch.zeros_like(q)
    splits = rows_num_splits(rows, heads, kv_heads, torch.cuda.get_device_properties(CUDA).multi_processor_count)

    def step() -> None:
        paged_rows_attention(q, kc, vc, table, lens, seqs, out, dim ** -0.5, splits)

    step()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for steps in ([(1456, 45)], [(4000, 13), (20, 30)], [(300, 2), (9, 1), (2500, 40)]):
        t, n, s = step_rows(steps, page_size, width, pages, gen)
        real = t.shape[0]
        table[:real], lens[:real], seqs[:real] = t, n, s
        seqs[real:] = -1
        q.copy_(torch.randn(q.shape, generator=gen, device=CUDA))
        graph.replay()
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out)  # the graph does what an eager launch does
        ref = decode_reference(q[:real], kc, vc, table[:real], n.tolist(), dim ** -0.5)
        assert rel(out[:real], ref) <= TOL[torch.bfloat16]
