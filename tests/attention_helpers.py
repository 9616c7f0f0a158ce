"""Paged KV set-ups shared by the attention and Triton-launch tests."""

from __future__ import annotations

import math

import torch
from mmpipe.language.attention.metadata import AttentionMetadata

CUDA = torch.device("cuda")


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


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """The new tokens' K/V into the cache (the model does this with the rotary embedding, before
    attention runs)."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)
