"""GPU attention against the torch reference backend, and replayed inside CUDA graphs.

Float32 must agree to 1e-5 relative, bfloat16 to 1e-2 (both sides round; the reference is
computed in float64 from the same inputs).
"""

from __future__ import annotations

import math

import pytest
import torch

from mmpipe.language.attention.metadata import AttentionMetadata
from mmpipe.language.attention.torch_backend import TorchLMAttention
from mmpipe.vision.attention import TorchVisionAttention
from mmpipe.vision.metadata import segments_of

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def paged_setup(seqs, page_size, heads, kv_heads, dim, dtype, seed, extra_rows=0):
    """seqs: (prefix, new) per sequence. Pages are shuffled; caches hold random prefixes."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    lens = [a + b for a, b in seqs]
    num_pages = 1 + sum(math.ceil(n / page_size) for n in lens) + 3
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    order = (torch.randperm(num_pages - 1, generator=gen, device=CUDA) + 1).tolist()
    width = max(1, max(math.ceil(n / page_size) for n in lens))
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots, used = [], 0
    for b, ((prefix, new), n) in enumerate(zip(seqs, lens)):
        count = math.ceil(n / page_size)
        table[b, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
        idx = torch.arange(prefix, n)
        slots.append(table[b].long()[idx // page_size] * page_size + idx % page_size)
    total_q = sum(new for _, new in seqs)
    q = torch.randn(total_q + extra_rows, heads, dim, generator=gen, device=CUDA).to(dtype)
    k = torch.randn(total_q + extra_rows, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    v = torch.randn(total_q + extra_rows, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    q_lens = [new for _, new in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    slot_mapping = torch.cat(slots + [torch.zeros(extra_rows, dtype=torch.long)]).to(CUDA)  # padding -> page 0
    meta = AttentionMetadata(
        is_decode=all(n == 1 for n in q_lens), num_tokens=total_q, slot_mapping=slot_mapping,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=CUDA), query_start_loc=qsl.to(CUDA),
        page_table=table.to(CUDA), seq_lens_host=lens, query_lens_host=q_lens, max_query_len=max(q_lens),
        max_seq_len=max(lens))
    return q, k, v, k_cache, v_cache, meta


def run_both(backend, q, k, v, k_cache, v_cache, meta):
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    ref = torch.zeros(q.shape, dtype=torch.float64, device=CUDA)
    TorchLMAttention(q.shape[-1] ** -0.5).forward(q.double(), k.double(), v.double(), ref, kc, vc, meta)
    out = torch.full_like(q, float("nan"))
    backend.forward(q, k, v, out, k_cache, v_cache, meta)
    return out, ref


def cuda_backend(extend="auto"):
    pytest.importorskip("triton")
    from mmpipe.language.attention.cuda_backend import CudaLMAttention

    return CudaLMAttention(1.0, extend)  # scale set per test below


# Every head dim (64/80/128), GQA ratio (1/2/7/8 as heads/kv_heads) and page size (1/16) appears,
# in varied combinations, without compiling the whole cross product.
SHAPES = [(64, 4, 4, 1), (80, 4, 2, 16), (128, 7, 1, 16), (64, 16, 2, 16), (80, 7, 1, 1), (128, 16, 2, 1),
          (128, 4, 4, 16), (80, 16, 2, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,heads,kv_heads,page_size", SHAPES)
def test_decode_matches_reference(dtype, dim, heads, kv_heads, page_size):
    lens = [1, 2, 17, 300, 1023, 4097] + ([32768] if page_size == 16 and dim == 128 else [])
    q, k, v, kc, vc, meta = paged_setup([(n - 1, 1) for n in lens], page_size, heads, kv_heads, dim, dtype,
                                        seed=dim + heads + page_size)
    backend = cuda_backend()
    backend.scale = dim ** -0.5
    out, ref = run_both(backend, q, k, v, kc, vc, meta)
    assert not out.isnan().any()
    for b in range(len(lens)):
        assert rel(out[b], ref[b]) <= TOL[dtype], (b, lens[b])


def test_decode_padding_rows_are_zero_and_harmless():
    q, k, v, kc, vc, meta = paged_setup([(9, 1), (40, 1)], 16, 8, 2, 128, torch.bfloat16, seed=3, extra_rows=3)
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(3, dtype=torch.int32, device=CUDA)])
    meta.page_table = torch.cat([meta.page_table, torch.zeros(3, meta.page_table.shape[1], dtype=torch.int32,
                                                               device=CUDA)])
    backend = cuda_backend()
    backend.scale = 128 ** -0.5
    before = kc.clone()
    out, ref = run_both(backend, q, k, v, kc, vc, meta)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert rel(out[:2], ref[:2]) <= 1e-2
    touched = (kc != before).flatten(1).any(1).nonzero().flatten().tolist()
    real_pages = meta.page_table[:2].unique().tolist()
    assert set(touched) <= set(real_pages) | {0}  # padding wrote only to the dummy page


# The varlen path is FlashAttention, which has no float32: float32 always takes the Triton path.
@pytest.mark.parametrize("extend,dtype", [("triton", torch.float32), ("triton", torch.bfloat16),
                                          ("varlen", torch.bfloat16)])
@pytest.mark.parametrize("dim,heads,kv_heads,page_size", SHAPES)
def test_extend_matches_reference(extend, dtype, dim, heads, kv_heads, page_size):
    seqs = [(0, 37), (17, 3), (333, 1), (1, 130), (0, 0), (4000, 65)]
    q, k, v, kc, vc, meta = paged_setup(seqs, page_size, heads, kv_heads, dim, dtype, seed=dim * heads)
    backend = cuda_backend(extend)
    backend.scale = dim ** -0.5
    out, ref = run_both(backend, q, k, v, kc, vc, meta)
    assert not out.isnan().any()
    assert rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_prefill_and_long_context_extend(dtype):
    """No cached prefix, and an 8k-token chunk over a 24k prefix (varlen under "auto" in bf16)."""
    for seqs in ([(0, 1), (0, 513), (0, 77)], [(24000, 8192)]):
        q, k, v, kc, vc, meta = paged_setup(seqs, 16, 16, 2, 128, dtype, seed=len(seqs))
        backend = cuda_backend()
        backend.scale = 128 ** -0.5
        out, ref = run_both(backend, q, k, v, kc, vc, meta)
        assert rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dim", [64, 80, 128])
def test_vit_varlen_matches_reference(dim):
    from mmpipe.vision.attention import VarlenVisionAttention

    lengths = [64, 64, 0, 256, 17, 64, 0, 1, 900]
    total = sum(lengths) + 11  # 11 trailing rows: a padding segment
    gen = torch.Generator(device=CUDA).manual_seed(dim)
    q, k, v = (torch.randn(total, 16, dim, generator=gen, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    seg = segments_of(lengths + [11], CUDA, max_len=1024)
    out = VarlenVisionAttention()(q, k, v, seg)
    ref = TorchVisionAttention()(q.double(), k.double(), v.double(), seg)
    assert rel(out, ref) <= 1e-2


def test_vit_attention_replays_with_new_boundaries():
    """Captured once; replayed with other segment boundaries of the same total; equals eager."""
    from mmpipe.vision.attention import VarlenVisionAttention

    attn = VarlenVisionAttention()
    total, bound = 18 * 16, 8 * 16
    layouts = [[4 * 16, 6 * 16, 8 * 16], [5 * 16, 5 * 16, 8 * 16], [8 * 16, 8 * 16, 2 * 16], [18 * 16 // 3] * 3]
    q, k, v = (torch.randn(total, 16, 80, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.zeros(4, dtype=torch.int32, device=CUDA)
    seg = segments_of(layouts[0], CUDA, max_len=bound)
    seg.cu_seqlens = cu
    cu.copy_(segments_of(layouts[0], CUDA).cu_seqlens)
    for _ in range(2):
        attn(q, k, v, seg)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(q, k, v, seg)
    for layout in layouts * 2:
        cu.copy_(segments_of(layout, CUDA).cu_seqlens)
        graph.replay()
        eager = attn(q, k, v, segments_of(layout, CUDA, max_len=bound))
        assert torch.equal(out, eager)


def test_decode_kernel_replays_with_new_lengths_and_page_tables():
    backend = cuda_backend()
    backend.scale = 128 ** -0.5
    batch, bound, page_size = 6, 4096, 16
    q, k, v, kc, vc, meta = paged_setup([(4095, 1)] * batch, page_size, 16, 2, 128, torch.bfloat16, seed=9)
    static = meta  # the graph reads these buffers; replays copy new values into them
    out = torch.zeros_like(q)
    for _ in range(2):
        backend.forward(q, k, v, out, kc, vc, static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(q, k, v, out, kc, vc, static)
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        lens = torch.randint(0, bound + 1, (batch,), generator=gen).int()
        lens[trial % batch] = 0  # a padding row
        pages = torch.randperm(kc.shape[0] - 1, generator=gen)[: batch * bound // page_size] + 1
        table = pages.view(batch, -1).int()
        slots = table.long()[torch.arange(batch), (lens.long() - 1).clamp(min=0) // page_size] * page_size + (
            (lens.long() - 1).clamp(min=0) % page_size)
        static.seq_lens.copy_(lens)
        static.page_table.copy_(table)
        static.slot_mapping.copy_(torch.where(lens > 0, slots, 0))
        graph.replay()
        replayed = out.clone()
        eager = torch.zeros_like(q)
        backend.forward(q, k, v, eager, kc, vc, static)
        assert torch.equal(replayed, eager)
        assert torch.equal(replayed[trial % batch], torch.zeros_like(replayed[0]))
