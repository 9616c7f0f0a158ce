"""The reference paged-KV attention against dense causal attention, and the ViT segment attention
against a block-diagonal mask."""

from __future__ import annotations

import math

import pytest
import torch
from mmpipe.language.attention.metadata import AttentionMetadata
from mmpipe.language.attention.torch_backend import TorchLMAttention
from mmpipe.language.kv_cache import KVCache
from mmpipe.vision.attention import TorchVisionAttention
from mmpipe.vision.metadata import segments_of

from mmpipe.engine.kv_pages import PageAllocator, pages_needed


def dense_causal(q, k, v, prefix: int):
    """q [n, H, D] at positions prefix.., k/v [prefix+n, KVH, D] -> [n, H, D], float64."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1).double()
    v = v.repeat_interleave(heads // kv_heads, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (torch.arange(n)[:, None] + prefix)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build(seqs, page_size, heads, kv_heads, dim, seed, decode=False):
    """seqs: list of (prefix_len, new_len). Fills each sequence's K/V (prefix and new: the model
    writes new K/V before attention) into the cache, returns inputs."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 1 + sum(pages_needed(a + b, page_size) for a, b in seqs)
    cache = KVCache(1, num_pages, page_size, kv_heads, dim, torch.float32, torch.device("cpu"))
    alloc = PageAllocator(num_pages)
    k_cache, v_cache = cache.layers[0]
    pages, full_k, full_v, qs, ks, vs, slots = [], [], [], [], [], [], []
    for prefix, new in seqs:
        p = alloc.allocate(pages_needed(prefix + new, page_size))
        p = p[::-1]  # non-contiguous, descending page ids
        pages.append(p)
        kk = torch.randn(prefix + new, kv_heads, dim, generator=gen)
        vv = torch.randn(prefix + new, kv_heads, dim, generator=gen)
        full_k.append(kk)
        full_v.append(vv)
        idx = torch.arange(prefix + new)
        slot = torch.tensor(p, dtype=torch.long)[idx // page_size] * page_size + idx % page_size
        k_cache.view(-1, kv_heads, dim)[slot] = kk
        v_cache.view(-1, kv_heads, dim)[slot] = vv
        slots.append(slot[prefix:])
        qs.append(torch.randn(new, heads, dim, generator=gen))
        ks.append(kk[prefix:])
        vs.append(vv[prefix:])
    width = max(len(p) for p in pages)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = torch.tensor(p)
    q_lens = [n for _, n in seqs]
    seq_lens = [a + b for a, b in seqs]
    meta = AttentionMetadata(
        is_decode=decode, num_tokens=sum(q_lens), slot_mapping=torch.cat(slots),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        page_table=table, seq_lens_host=seq_lens, query_lens_host=q_lens, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens))
    return (k_cache, v_cache), meta, torch.cat(qs), torch.cat(ks), torch.cat(vs), full_k, full_v


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (7, 1), (8, 1)])
def test_extend_matches_dense(page_size, heads, kv_heads):
    seqs = [(0, 5), (17, 3), (33, 1), (1, 20)]
    (kc, vc), meta, q, k, v, full_k, full_v = build(seqs, page_size, heads, kv_heads, 16, seed=page_size + heads)
    out = torch.full_like(q, float("nan"))
    assert TorchLMAttention(16 ** -0.5).forward(q, k, v, meta, out, (kc, vc)) is out
    start = 0
    for (prefix, new), kk, vv in zip(seqs, full_k, full_v):
        ref = dense_causal(q[start:start + new], kk, vv, prefix)
        assert torch.allclose(out[start:start + new].double(), ref, atol=1e-5)
        start += new


def test_decode_and_padding_rows():
    """Decode batch (one query per sequence); rows past num_tokens are padding and read as zero."""
    seqs = [(9, 1), (40, 1), (0, 1)]
    (kc, vc), meta, q, k, v, full_k, full_v = build(seqs, 4, 4, 2, 8, seed=3, decode=True)
    pad = 2
    q = torch.cat([q, torch.randn(pad, 4, 8)])
    k = torch.cat([k, torch.randn(pad, 2, 8)])
    v = torch.cat([v, torch.randn(pad, 2, 8)])
    out = torch.full_like(q, float("nan"))
    TorchLMAttention(8 ** -0.5).forward(q, k, v, meta, out, (kc, vc))
    for i, ((prefix, _), kk, vv) in enumerate(zip(seqs, full_k, full_v)):
        assert torch.allclose(out[i:i + 1].double(), dense_causal(q[i:i + 1], kk, vv, prefix), atol=1e-5)
    assert torch.equal(out[-pad:], torch.zeros(pad, 4, 8))


def test_attention_reads_keys_from_the_cache_not_its_arguments():
    """K/V are written by the rotary+KV op before attention; the backend must read the cache (a
    backend that attended to the k/v arguments would ignore the cached prefix)."""
    seqs = [(3, 4)]
    (kc, vc), meta, q, k, v, full_k, full_v = build(seqs, 2, 2, 2, 4, seed=5)
    out = TorchLMAttention(0.5).forward(q, torch.zeros_like(k), torch.zeros_like(v), meta, None, (kc, vc))
    assert torch.allclose(out.double(), dense_causal(q, full_k[0], full_v[0], 3), atol=1e-5)
    with pytest.raises(ValueError, match="cache"):
        TorchLMAttention(0.5).forward(q, k, v, meta)


def test_vision_segments_match_block_diagonal_mask():
    lengths = [16, 16, 16, 4, 0, 36, 16]
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total + 3, 2, 8, generator=gen) for _ in range(3))  # 3 rows of no segment
    out = TorchVisionAttention().forward(q, k, v, segments_of(lengths, torch.device("cpu")))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seg[:, None] == seg[None, :]
    scores = torch.einsum("qhd,khd->hqk", q[:total].double(), k[:total].double()) / math.sqrt(8)
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v[:total].double())
    assert torch.allclose(out[:total].double(), ref, atol=1e-5)
    assert torch.equal(out[total:], torch.zeros(3, 2, 8))


def test_page_allocator_never_hands_out_the_dummy_page():
    alloc = PageAllocator(5)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and alloc.num_free == 0
    with pytest.raises(MemoryError):
        alloc.allocate(1)
    alloc.free(pages[:2])
    assert alloc.num_free == 2
