"""GPU attention against the torch reference backend, and replayed inside CUDA graphs; the fused
rotary + KV-cache write against its PyTorch reference.

Attention: float32 must agree to 1e-5 relative, bfloat16 to 1e-2 (both sides round; the reference
is computed in float64 from the same inputs). The rotary + KV write must agree bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from mmpipe.language.attention.metadata import AttentionMetadata
from mmpipe.language.attention.torch_backend import TorchLMAttention
from mmpipe.vision.attention import TorchVisionAttention
from mmpipe.vision.metadata import segments_of

from mmpipe.kernels.rope_kv import rope_qk_write_kv, rope_qk_write_kv_reference

pytestmark = pytest.mark.gpu
from tests.attention_helpers import paged_setup, rel, write_kv  # noqa: E402

CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def run_both(backend, q, k, v, k_cache, v_cache, meta):
    rows = meta.slot_mapping.shape[0]
    write_kv(k_cache, v_cache, k[:rows], v[:rows], meta.slot_mapping)
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    ref = torch.zeros(q.shape, dtype=torch.float64, device=CUDA)
    TorchLMAttention(q.shape[-1] ** -0.5).forward(q.double(), k.double(), v.double(), meta, ref, (kc, vc))
    out = torch.full_like(q, float("nan"))
    backend.forward(q, k, v, meta, out, (k_cache, v_cache))
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


def test_decode_padding_rows_are_zero():
    q, k, v, kc, vc, meta = paged_setup([(9, 1), (40, 1)], 16, 8, 2, 128, torch.bfloat16, seed=3, extra_rows=3)
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(3, dtype=torch.int32, device=CUDA)])
    meta.page_table = torch.cat([meta.page_table, torch.zeros(3, meta.page_table.shape[1], dtype=torch.int32,
                                                               device=CUDA)])
    backend = cuda_backend()
    backend.scale = 128 ** -0.5
    out, ref = run_both(backend, q, k, v, kc, vc, meta)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert rel(out[:2], ref[:2]) <= 1e-2


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
@pytest.mark.parametrize("dim,heads,kv_heads,page_size", SHAPES[:4])
def test_a_few_tokens_over_long_cached_contexts_run_as_decode_rows(dtype, dim, heads, kv_heads, page_size):
    """A prompt found cached but for its last tokens: each query token a decode row of its own."""
    seqs = [(1500, 13), (17, 3), (0, 0), (333, 1), (4000, 64)]
    q, k, v, kc, vc, meta = paged_setup(seqs, page_size, heads, kv_heads, dim, dtype, seed=dim + 5 * heads)
    backend = cuda_backend()
    backend.scale = dim ** -0.5
    out, ref = run_both(backend, q, k, v, kc, vc, meta)
    assert meta.decode_rows is not None  # the path under test ran
    assert rel(out, ref) <= TOL[dtype]


def test_the_decode_rows_switch_turns_the_path_off(switch):
    seqs = [(1500, 13), (17, 3)]
    q, k, v, kc, vc, meta = paged_setup(seqs, 16, 16, 2, 128, torch.bfloat16, seed=3)
    switch("extend-decode-rows", "0")
    backend = cuda_backend()
    backend.scale = 128 ** -0.5
    out, ref = run_both(backend, q, k, v, kc, vc, meta)
    assert meta.decode_rows is None and rel(out, ref) <= TOL[torch.bfloat16]


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
    out = VarlenVisionAttention().forward(q, k, v, seg)
    ref = TorchVisionAttention().forward(q.double(), k.double(), v.double(), seg)
    assert rel(out, ref) <= 1e-2


def test_the_direct_flash_call_equals_torchs_varlen_attn():
    """mmpipe calls the aten op `varlen_attn` wraps (without its custom-op wrapper): the same
    bits on segments longer than the short-segment kernel takes."""
    from torch.nn.attention.varlen import varlen_attn

    from mmpipe.layers.attention import flash_varlen

    lengths = [300, 129, 1024, 7]
    gen = torch.Generator(device=CUDA).manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), 16, 80, generator=gen, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    seg = segments_of(lengths, CUDA, max_len=1024)
    ours = flash_varlen(q, k, v, seg.cu_seqlens, seg.cu_seqlens, seg.max_len, seg.max_len)
    assert torch.equal(ours, varlen_attn(q, k, v, seg.cu_seqlens, seg.cu_seqlens, seg.max_len, seg.max_len))


def test_the_direct_causal_flash_call_equals_varlen_attn_with_a_cached_prefix():
    """The language model's long-context extend: queries are the last tokens of each sequence,
    keys its whole context (prefix first). `causal=True` must be the bottom-right aligned mask
    that varlen_attn's window (-1, 0) gives, with the same scale, bit for bit."""
    from torch.nn.attention.varlen import varlen_attn

    from mmpipe.layers.attention import flash_varlen

    new, context = [5, 300, 64], [900, 300, 1500]  # the 2nd has no prefix
    gen = torch.Generator(device=CUDA).manual_seed(5)
    q = torch.randn(sum(new), 16, 128, generator=gen, device=CUDA, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(context), 16, 128, generator=gen, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    cu_q = torch.tensor([0, 5, 305, 369], device=CUDA, dtype=torch.int32)
    cu_k = torch.tensor([0, 900, 1200, 2700], device=CUDA, dtype=torch.int32)
    ours = flash_varlen(q, k, v, cu_q, cu_k, 300, 1500, causal=True, scale=0.07)
    theirs = varlen_attn(q, k, v, cu_q, cu_k, 300, 1500, scale=0.07, window_size=(-1, 0))
    assert torch.equal(ours, theirs)
    unmasked = flash_varlen(q, k, v, cu_q, cu_k, 300, 1500, causal=False, scale=0.07)
    assert not torch.equal(ours, unmasked)  # the mask matters on these lengths


@pytest.mark.parametrize("short_segments", [True, False])
def test_vit_attention_replays_with_new_boundaries(short_segments):
    """Captured once; replayed with other segment boundaries of the same total; equals eager
    (segments of up to 128 tokens: the short-segment kernel, or FlashAttention)."""
    from mmpipe.vision.attention import VarlenVisionAttention

    attn = VarlenVisionAttention(short_segments=short_segments)
    total, bound = 18 * 16, 8 * 16
    layouts = [[4 * 16, 6 * 16, 8 * 16], [5 * 16, 5 * 16, 8 * 16], [8 * 16, 8 * 16, 2 * 16], [18 * 16 // 3] * 3]
    q, k, v = (torch.randn(total, 16, 80, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.zeros(4, dtype=torch.int32, device=CUDA)
    seg = segments_of(layouts[0], CUDA, max_len=bound)
    seg.cu_seqlens = cu
    cu.copy_(segments_of(layouts[0], CUDA).cu_seqlens)
    for _ in range(2):
        attn.forward(q, k, v, seg)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward(q, k, v, seg)
    for layout in layouts * 2:
        cu.copy_(segments_of(layout, CUDA).cu_seqlens)
        graph.replay()
        eager = attn.forward(q, k, v, segments_of(layout, CUDA, max_len=bound))
        assert torch.equal(out, eager)


def test_decode_kernel_replays_with_new_lengths_and_page_tables():
    """The engine's decode call (KV write, then the backend with its own split count) captured once
    and replayed with other lengths, padding rows and page tables: equals eager."""
    backend = cuda_backend()
    backend.scale = 128 ** -0.5
    batch, bound, page_size = 6, 4096, 16
    q, k, v, kc, vc, meta = paged_setup([(4095, 1)] * batch, page_size, 16, 2, 128, torch.bfloat16, seed=9)
    static = meta  # the graph reads these buffers; replays copy new values into them
    out = torch.zeros_like(q)

    def step(result):
        write_kv(kc, vc, k, v, static.slot_mapping)
        backend.forward(q, k, v, static, result, (kc, vc))

    for _ in range(2):
        step(out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(out)
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
        step(eager)
        assert torch.equal(replayed, eager)
        assert torch.equal(replayed[trial % batch], torch.zeros_like(replayed[0]))


# ---------------------------------------------------------------------------- fixed-split decode

def num_sms() -> int:
    return torch.cuda.get_device_properties(CUDA).multi_processor_count


def decode_reference(q, k_cache, v_cache, page_table, lens, scale):
    """The torch reference backend in float64, one sequence at a time (so that zero-length rows
    anywhere in the batch are simply zeros)."""
    kc, vc = k_cache.double(), v_cache.double()
    ref = torch.zeros(q.shape, dtype=torch.float64, device=CUDA)
    backend = TorchLMAttention(scale)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        meta = AttentionMetadata(
            is_decode=True, num_tokens=1, slot_mapping=torch.zeros(1, dtype=torch.long, device=CUDA),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=CUDA), query_start_loc=None,
            page_table=page_table[b:b + 1], seq_lens_host=[n], query_lens_host=[1], max_query_len=1, max_seq_len=n)
        backend.forward(q[b:b + 1].double(), None, None, meta, ref[b:b + 1], (kc, vc))
    return ref


def poison_allocator(nbytes: int = 64 << 20) -> None:
    """Leave NaNs in the caching allocator's free blocks, so that a kernel reading memory it never
    wrote (an empty split's partial output, say) shows up as NaN."""
    junk = torch.full((nbytes // 4,), float("nan"), device=CUDA)
    del junk


def random_paged(lens, page_size, heads, kv_heads, dim, dtype, seed, width=None, pages=None):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    need = [math.ceil(n / page_size) for n in lens]
    width = width or max(1, max(need))
    pages = pages or 1 + len(lens) * width
    kc = torch.randn(pages, page_size, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    vc = torch.randn(pages, page_size, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    table = (torch.randperm(pages - 1, generator=gen, device=CUDA)[: len(lens) * width] + 1).view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=gen, device=CUDA).to(dtype)
    return q, kc, vc, table.int().contiguous(), torch.tensor(lens, dtype=torch.int32, device=CUDA)


def test_decode_num_splits():
    from mmpipe.kernels.decode_attention import decode_num_splits

    assert [decode_num_splits(b, 2, 132) for b in (1, 32, 128, 256)] == [64, 5, 2, 1]  # 3B shape, 132 SMs
    for sms in (1, 78, 132, 144):
        previous = 64
        for batch in range(1, 600):
            for kv_heads in (1, 2, 4):
                splits = decode_num_splits(batch, kv_heads, sms)
                assert 1 <= splits <= 64
                rows = batch * kv_heads
                if 1 < splits < 64:  # fills the GPU ~2-4 programs per SM
                    assert 2 * sms <= rows * splits < 4 * sms
                assert (splits == 1) == (rows >= 2 * sms)  # one split (no reduce) once rows alone fill the GPU
            splits = decode_num_splits(batch, 2, sms)
            assert splits <= previous  # more sequences, fewer splits
            previous = splits


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,heads,kv_heads,page_size", [(128, 16, 2, 16), (80, 7, 1, 1), (64, 4, 4, 16)])
def test_fixed_split_decode_matches_reference(num_splits, dtype, dim, heads, kv_heads, page_size):
    """Lengths around the key block (16/17 vs 64-token blocks), below and above the split count
    (splits with no tokens at 64 splits), and a padding row of length 0 in the middle."""
    from mmpipe.kernels.decode_attention import paged_decode

    lens = [1, 15, 16, 0, 17, 300, 4097]
    q, kc, vc, table, seq_lens = random_paged(lens, page_size, heads, kv_heads, dim, dtype, seed=dim + num_splits)
    poison_allocator()
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, table, seq_lens, out, dim ** -0.5, num_splits)
    ref = decode_reference(q, kc, vc, table, lens, dim ** -0.5)
    assert not out.isnan().any()
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
        else:
            assert rel(out[b], ref[b]) <= TOL[dtype], (b, n)


def test_single_split_writes_out_directly(monkeypatch):
    """num_splits == 1: one kernel, no partial buffers, no reduce launch."""
    from mmpipe.kernels import decode_attention as triton_decode

    lens = [1, 17, 300, 4097, 0]
    q, kc, vc, table, seq_lens = random_paged(lens, 16, 16, 2, 128, torch.bfloat16, seed=1)
    out = torch.full_like(q, float("nan"))
    triton_decode.paged_decode(q, kc, vc, table, seq_lens, out, 128 ** -0.5, 1)  # compile outside the check
    monkeypatch.setattr(triton_decode, "_decode_reduce_kernel", None)  # any reduce launch would fail
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.fill_(float("nan"))
    triton_decode.paged_decode(q, kc, vc, table, seq_lens, out, 128 ** -0.5, 1)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before  # no temporaries
    ref = decode_reference(q, kc, vc, table, lens, 128 ** -0.5)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert rel(out[:4], ref[:4]) <= 1e-2
    split = torch.empty_like(out)
    monkeypatch.undo()
    triton_decode.paged_decode(q, kc, vc, table, seq_lens, split, 128 ** -0.5, 8)
    assert rel(out[:4], split[:4]) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", ["auto", 1, 7])
def test_decode_graph_replays_any_lengths(dtype, splits):
    """paged_decode captured once (at short lengths) and replayed with longer and shorter lengths
    and new page tables: matches the reference, and equals an eager call bit for bit."""
    from mmpipe.kernels.decode_attention import decode_num_splits, paged_decode

    batch, heads, kv_heads, dim, page_size, longest = 5, 16, 2, 128, 16, 4097
    width = math.ceil(longest / page_size)
    num_splits = decode_num_splits(batch, kv_heads, num_sms()) if splits == "auto" else splits
    q, kc, vc, table, seq_lens = random_paged([20] * batch, page_size, heads, kv_heads, dim, dtype, seed=4,
                                              width=width, pages=1 + batch * width + 8)
    scale = dim ** -0.5
    out = torch.zeros_like(q)
    for _ in range(2):
        paged_decode(q, kc, vc, table, seq_lens, out, scale, num_splits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(q, kc, vc, table, seq_lens, out, scale, num_splits)
    gen = torch.Generator().manual_seed(1)
    trials = [[1, 4097, 300, 0, 17], [4097] * 5, [16, 15, 1, 2, 0], [64, 65, 128, 1000, 2049], [0] * 5, [3] * 5]
    for lens in trials:
        new_table = (torch.randperm(kc.shape[0] - 1, generator=gen)[: batch * width] + 1).view(batch, width).int()
        table.copy_(new_table)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        graph.replay()
        replayed = out.clone()
        eager = torch.full_like(q, float("nan"))
        paged_decode(q, kc, vc, table, seq_lens, eager, scale, num_splits)
        assert torch.equal(replayed, eager), lens
        ref = decode_reference(q, kc, vc, table, lens, scale)
        for b, n in enumerate(lens):
            if n == 0:
                assert torch.equal(replayed[b], torch.zeros_like(replayed[b]))
            else:
                assert rel(replayed[b], ref[b]) <= TOL[dtype], (lens, b)


# ---------------------------------------------------------------------------- rotary + KV write

def rope_inputs(rows, heads, kv_heads, dim, dtype, page_size=16, seed=0, random_tables=False, padded=0):
    """qkv, cos, sin, caches, slot_mapping; the last `padded` rows write the dummy page 0."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen, device=CUDA) * 4).to(dtype)
    if random_tables:
        cos = torch.randn(rows, dim, generator=gen, device=CUDA).to(dtype)
        sin = torch.randn(rows, dim, generator=gen, device=CUDA).to(dtype)
    else:  # as the model builds them: float32 angles, then the dtype
        pos = torch.randint(0, 32768, (rows,), generator=gen, device=CUDA).float()
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=CUDA).float() / dim))
        emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    pages = rows // page_size + 4
    kc = torch.randn(pages, page_size, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    vc = torch.randn(pages, page_size, kv_heads, dim, generator=gen, device=CUDA).to(dtype)
    slots = torch.randperm((pages - 1) * page_size, generator=gen, device=CUDA)[:rows] + page_size
    if padded:
        slots[rows - padded:] = torch.arange(padded, device=CUDA) % page_size
    return qkv, cos, sin, kc, vc, slots


ROPE_SHAPES = [(16, 2, 128, 16), (4, 4, 64, 16), (7, 1, 80, 1), (28, 4, 128, 16)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim,page_size", ROPE_SHAPES)
@pytest.mark.parametrize("rows", [1, 37, 256, 8192])
def test_rope_qk_write_kv_matches_reference_bit_for_bit(dtype, heads, kv_heads, dim, page_size, rows):
    if rows == 8192 and (heads, kv_heads, dim) != (16, 2, 128):
        pytest.skip("prefill size: the 3B shape only")
    for random_tables in (False, True):
        qkv, cos, sin, kc, vc, slots = rope_inputs(rows, heads, kv_heads, dim, dtype, page_size, seed=rows + dim,
                                                   random_tables=random_tables)
        kc2, vc2 = kc.clone(), vc.clone()
        q, k, v = rope_qk_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
        q2, k2, v2 = rope_qk_write_kv_reference(qkv, cos, sin, kc2, vc2, slots, heads, kv_heads, dim)
        assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        assert q.is_contiguous() and k.is_contiguous() and v.data_ptr() == v2.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_qk_write_kv_padding_rows_touch_only_the_dummy_page(dtype):
    heads, kv_heads, dim, page_size = 16, 2, 128, 16
    qkv, cos, sin, kc, vc, slots = rope_inputs(40, heads, kv_heads, dim, dtype, page_size, seed=2, padded=8)
    before_k, before_v = kc.clone(), vc.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    q, k, v = rope_qk_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    q2, k2, _ = rope_qk_write_kv_reference(qkv, cos, sin, kc2, vc2, slots, heads, kv_heads, dim)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    # several padding rows share dummy slots (which one lands there is unordered): compare the rest
    assert torch.equal(kc[1:], kc2[1:]) and torch.equal(vc[1:], vc2[1:])
    changed = ((kc != before_k) | (vc != before_v)).flatten(1).any(1).nonzero().flatten().tolist()
    real_pages = set((slots[:32] // page_size).tolist())
    assert set(changed) <= real_pages | {0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_qk_write_kv_replays_in_a_graph(dtype):
    """Captured once; replayed with new qkv, tables and slot_mapping: same bits as the reference."""
    heads, kv_heads, dim, page_size, rows = 16, 2, 128, 16, 32
    qkv, cos, sin, kc, vc, slots = rope_inputs(rows, heads, kv_heads, dim, dtype, page_size, seed=0)
    for _ in range(2):
        rope_qk_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k, v = rope_qk_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim)
    for trial in range(4):
        new = rope_inputs(rows, heads, kv_heads, dim, dtype, page_size, seed=trial + 1, random_tables=trial % 2 == 1,
                          padded=4 if trial == 2 else 0)
        for static, value in zip((qkv, cos, sin), new[:3]):
            static.copy_(value)
        slots.copy_(new[5])
        kc2, vc2 = kc.clone(), vc.clone()
        graph.replay()
        q2, k2, v2 = rope_qk_write_kv_reference(qkv, cos, sin, kc2, vc2, slots, heads, kv_heads, dim)
        assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
        assert torch.equal(kc[1:], kc2[1:]) and torch.equal(vc[1:], vc2[1:])  # page 0: the dummy page


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_vit_short_segment_kernel_matches_reference(dim, dtype):
    """The windows' kernel on segments of 1..64 tokens (and empty ones), with q/k/v as strided
    views of one fused qkv, as the ViT passes them: equal to the float64 reference, and to
    FlashAttention within rounding."""
    from mmpipe.vision.attention import VarlenVisionAttention

    from mmpipe.kernels.window_attention import short_segment_attention

    lengths = [64, 64, 0, 17, 1, 64, 33, 0, 64, 5]
    total = sum(lengths)
    gen = torch.Generator(device=CUDA).manual_seed(dim)
    qkv = torch.randn(total, 3, 16, dim, generator=gen, device=CUDA, dtype=dtype)
    q, k, v = qkv.unbind(1)
    seg = segments_of(lengths, CUDA)
    assert seg.max_len == 64
    out = VarlenVisionAttention().forward(q, k, v, seg)
    ref = TorchVisionAttention().forward(q.double(), k.double(), v.double(), seg)
    assert rel(out, ref) <= 1e-2
    flash = VarlenVisionAttention(short_segments=False).forward(q, k, v, seg)
    assert rel(out, flash) <= 1e-2
    with pytest.raises(ValueError, match="at most 128"):
        short_segment_attention(q, k, v, seg.cu_seqlens, 200)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (4, 2, 24), (16, 8, 128)])
@pytest.mark.parametrize("rows", [1, 37, 4096])
def test_rope_with_qk_norm_matches_reference(dtype, heads, kv_heads, dim, rows):
    """Qwen3's per-head q/k RMSNorm inside the rotary + KV write kernel, against the reference
    (the norm's float32 statistics may differ in the last bit of their sum order and rsqrt: bf16
    results equal but for rare one-ulp flips, float32 within 1e-6)."""
    qkv, cos, sin, kc, vc, slots = rope_inputs(rows, heads, kv_heads, dim, dtype, 16, seed=rows + dim)
    gen = torch.Generator(device=CUDA).manual_seed(dim)
    q_norm = (1 + 0.3 * torch.randn(dim, generator=gen, device=CUDA)).to(dtype)
    k_norm = (1 + 0.3 * torch.randn(dim, generator=gen, device=CUDA)).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    q, k, v = rope_qk_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, dim, q_norm, k_norm, 1e-6)
    q2, k2, _ = rope_qk_write_kv_reference(qkv, cos, sin, kc2, vc2, slots, heads, kv_heads, dim, q_norm, k_norm, 1e-6)
    plain, _, _ = rope_qk_write_kv_reference(qkv, cos, sin, kc2.clone(), vc2.clone(), slots, heads, kv_heads, dim)
    assert rel(q, plain) > 0.05  # the norm really acts
    for ours, ref in ((q, q2), (k, k2), (kc, kc2), (vc, vc2)):
        if dtype == torch.float32:
            assert rel(ours, ref) <= 1e-6
        else:
            assert (ours != ref).float().mean().item() <= 1e-3 and rel(ours, ref) <= 1e-3


# ---------------------------------------------------------------------------- rotary inside decode

DECODE_ROPE_LENS = [1, 15, 16, 0, 17, 64, 65, 300, 4097]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim,page_size", ROPE_SHAPES + [(4, 2, 16, 16)])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_decode_with_rope_equals_rope_then_decode(dtype, heads, kv_heads, dim, page_size, num_splits):
    """`paged_decode_rope` against `rope_qk_write_kv` + `paged_decode`: output and cache bit for bit
    (page 0, the dummy page, takes the padding rows' writes in no fixed order)."""
    from tests.unit.test_decode_rope import fused_and_unfused

    poison_allocator()
    fused, unfused = fused_and_unfused(DECODE_ROPE_LENS, heads, kv_heads, dim, dtype, page_size, num_splits, CUDA,
                                       seed=dim + num_splits)
    assert torch.isfinite(fused[0]).all()
    assert torch.equal(fused[0], unfused[0])
    assert torch.equal(fused[1][1:], unfused[1][1:]) and torch.equal(fused[2][1:], unfused[2][1:])


@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_decode_with_rope_orders_the_new_tokens_store_before_its_read(num_splits):
    """Many rows whose newest position falls in a late split, repeated: the split holding it
    stores the new K/V and must see them in its own loop (the slots hold NaN before: a read before
    the store landed would give NaN). The compiled order is checked in test_decode_rope.py."""
    from tests.unit.test_decode_rope import fused_and_unfused

    lens = [64 * num_splits - 1, 64 * num_splits, 4096 + 63, 300, 1000] * 24
    for seed in range(3):
        fused, unfused = fused_and_unfused(lens, 16, 2, 128, torch.bfloat16, 16, num_splits, CUDA, seed=seed)
        assert torch.equal(fused[0], unfused[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (16, 8, 128), (4, 2, 24)])
def test_decode_with_rope_and_qk_norm(dtype, heads, kv_heads, dim):
    """Qwen3's head norm inside the decode kernel: its float32 statistic sums in another order
    than `rope_qk_write_kv`'s, so float32 within 1e-5, bfloat16 within a few ulp flips."""
    from tests.unit.test_decode_rope import fused_and_unfused

    fused, unfused = fused_and_unfused(DECODE_ROPE_LENS, heads, kv_heads, dim, dtype, 16, 7, CUDA, seed=dim,
                                       qk_norm=True)
    plain, _ = fused_and_unfused(DECODE_ROPE_LENS, heads, kv_heads, dim, dtype, 16, 7, CUDA, seed=dim)
    assert rel(plain[0], fused[0]) > 0.05  # the norm acts
    assert torch.equal(fused[2][1:], unfused[2][1:])  # V is not normed: the same bits
    new_k = fused[1][1:] != unfused[1][1:]
    print(f"qk norm {dtype} {heads}/{kv_heads}x{dim}: out rel {rel(fused[0], unfused[0]):.2e}, "
          f"k cache rel {rel(fused[1][1:], unfused[1][1:]):.2e}, flipped {int(new_k.sum())}")
    if dtype == torch.float32:
        assert rel(fused[0], unfused[0]) <= 1e-6 and rel(fused[1][1:], unfused[1][1:]) <= 1e-6
    else:  # rare one-ulp flips of the normed values
        assert rel(fused[0], unfused[0]) <= 2e-3 and new_k.float().mean().item() <= 1e-3
