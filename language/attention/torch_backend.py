"""Reference LM attention over the paged KV cache, in plain PyTorch.

Runs on the CPU and on CUDA; gathers each sequence's pages and calls scaled_dot_product_attention
with an explicit causal mask offset by the cached prefix. It loops over sequences on the host, so
it is not capturable; it is the oracle the GPU kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpipe.language.attention.metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows [T, kv_heads, dim] into their slots (graph-safe)."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence whose pages are `pages`: [length, kv_heads, dim]."""
    heads, dim = cache.shape[-2:]
    return cache.index_select(0, pages).reshape(-1, heads, dim)[:length]


class TorchLMAttention:
    name = "torch"
    graph_safe = False

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D] (written in place)."""
        n = meta.num_tokens
        write_kv(k_cache, v_cache, k[:n], v[:n], meta.slot_mapping[:n])
        page_size = k_cache.shape[1]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            if q_len == 0:
                continue
            pages = meta.page_table[i, : -(-seq_len // page_size)]
            keys = gather_kv(k_cache, pages, seq_len).transpose(0, 1).unsqueeze(0)
            values = gather_kv(v_cache, pages, seq_len).transpose(0, 1).unsqueeze(0)
            query = q[start:start + q_len].transpose(0, 1).unsqueeze(0)
            mask = None
            if q_len > 1:  # query j sits at position seq_len - q_len + j and sees keys up to it
                rows = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            result = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale,
                                                    enable_gqa=keys.shape[1] != query.shape[1])
            out[start:start + q_len] = result[0].transpose(0, 1)
            start += q_len
        if start < out.shape[0]:
            out[start:] = 0
