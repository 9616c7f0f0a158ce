"""Reference LM attention over the paged KV cache, in plain PyTorch.

Runs on the CPU and on CUDA; gathers each sequence's pages and calls scaled_dot_product_attention
with an explicit causal mask offset by the cached prefix. It loops over sequences on the host, so
it is not capturable; it is the oracle the GPU kernels are checked against. New K/V are already in
the cache when it runs (written with the rotary embedding, `language/rope_kv.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mmpipe.language.attention.metadata import AttentionMetadata, RowsDecision


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence whose pages are `pages`: [length, kv_heads, dim]."""
    heads, dim = cache.shape[-2:]
    return cache.index_select(0, pages).reshape(-1, heads, dim)[:length]


class TorchLMAttention(RowsDecision):
    name = "torch"
    graph_safe = False

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def rows_fit(self, max_query_len: int, max_seq_len: int, sequences: int, heads: int, device: torch.device) -> bool:
        """Never: the reference attends each sequence's queries at once (see the CUDA backend)."""
        return False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor | None = None,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]; keys and values come from the cache (the new ones were
        written there before the call). Rows past the real tokens are zeros."""
        if cache is None:
            raise ValueError("the LM attention reads K/V from the paged cache: pass cache=(k_cache, v_cache)")
        k_cache, v_cache = cache
        out = torch.empty_like(q) if out is None else out
        page_size = k_cache.shape[1]
        seq_lens, query_lens = meta.seq_lens_host, meta.query_lens_host
        if seq_lens is None:  # a step built for a graph: read the lengths back (a sync; fine here)
            seq_lens = meta.seq_lens.tolist()
            query_lens = [1] * len(seq_lens) if meta.is_decode else \
                torch.diff(meta.query_start_loc).tolist()  # type: ignore[arg-type]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
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
        return out
