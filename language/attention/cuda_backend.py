"""LM attention on CUDA: Triton paged decode (split-KV, capturable) and extend attention.

Extend has two implementations:
- "triton": the Triton kernel, reading the cached prefix through the page table;
- "varlen": FlashAttention inside PyTorch (the aten varlen forward that `varlen_attn` wraps,
  called without its wrapper, whose first call imports `torch._dynamo`), straight on the new K/V
  when no sequence has a cached prefix, else on the prefix gathered into contiguous K/V.
"auto" picks by context length, as `mmpipe bench kernels` measured (docs/performance.md): the
Triton kernel up to a few thousand tokens of context, varlen from about 8k on. Float32 always
uses Triton (FlashAttention has no float32).

A step whose sequences each add only a few tokens to a long cached context (a prompt found in
the prefix cache but for its last page) would give the extend kernel a program per sequence and
head, leaving most of the GPU idle: there every query token runs as a row (its sequence's page
table, its causal length) through the split-KV rows kernel (`kernels/rows_attention`), which
reads each key block once for a block of rows of one sequence.
"""

from __future__ import annotations

import torch
from mmpipe.language.attention.metadata import AttentionMetadata, RowsDecision, decode_rows

from mmpipe import settings
from mmpipe.kernels.decode_attention import decode_num_splits, paged_decode, paged_decode_rope
from mmpipe.kernels.extend_attention import paged_extend
from mmpipe.kernels.rows_attention import paged_rows_attention, rows_num_splits
from mmpipe.layers.attention import flash_varlen, flash_varlen_available

VARLEN_FROM_CONTEXT = 8192  # "auto": longest context from which varlen beat the Triton kernel
# Decode buckets from which the rotary + KV write run inside the attention kernel: faster per step
# from two rows on, slower at one row, where every split's program rotates the same query heads
# before its short loop (measured; docs/performance.md).
ROPE_FUSED_FROM_ROWS = 2
# Extend steps as decode rows: at most this many query tokens per sequence, over a context of at
# least DECODE_ROWS_FROM_CONTEXT tokens, with fewer extend programs than SMs.
DECODE_ROWS_UP_TO = 64
DECODE_ROWS_FROM_CONTEXT = 256


class CudaLMAttention(RowsDecision):
    """`forward`: the new K/V are in the cache already (written with the rotary embedding).
    `decode_rope`: a decode step's rotary and K/V write inside the attention kernel."""

    name = "cuda"
    graph_safe = True

    def __init__(self, scale: float, extend: str = "auto") -> None:
        if extend not in ("auto", "triton", "varlen"):
            raise ValueError(f"extend={extend!r}: use 'auto', 'triton' or 'varlen'")
        self.scale = scale
        self.extend = extend
        self._varlen = flash_varlen_available()
        self._num_sms: dict[int, int] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor | None = None,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if cache is None:
            raise ValueError("the LM attention reads K/V from the paged cache: pass cache=(k_cache, v_cache)")
        k_cache, v_cache = cache
        out = torch.empty_like(q) if out is None else out
        if meta.extend_rows:  # a row graph's step: its rows are in `decode_rows`
            return self._rows(q, k_cache, v_cache, meta, out)
        if meta.is_decode:
            # The split count depends only on the batch rows (never on lengths), so a captured
            # step serves any lengths.
            splits = decode_num_splits(meta.split_rows or q.shape[0], k_cache.shape[2], self._sms(q.device))
            paged_decode(q, k_cache, v_cache, meta.page_table, meta.seq_lens, out, self.scale, splits)
            return out
        if self.runs_as_rows(meta, q.shape[1], q.device):
            if meta.decode_rows is None:  # once per forward: every layer reads the same rows
                meta.decode_rows = decode_rows(meta)
            return self._rows(q, k_cache, v_cache, meta, out)
        if self._use_varlen(q.dtype, meta):
            if meta.query_lens_host == meta.seq_lens_host:  # nothing cached: attend to the new K/V
                n = meta.num_tokens
                self._varlen_causal(q, k[:n], v[:n], out, meta.query_start_loc, meta.query_start_loc,
                                    meta.max_query_len, meta.max_query_len, meta.num_tokens)
            else:
                keys, values, cu_k = gather_context(k_cache, v_cache, meta)
                self._varlen_causal(q, keys, values, out, meta.query_start_loc, cu_k, meta.max_query_len,
                                    meta.max_seq_len, meta.num_tokens)
        else:  # reads only the real rows (by query_start_loc), whatever the padding
            paged_extend(q, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.query_start_loc, out,
                         self.scale, meta.max_query_len)
        return out

    def _rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
              out: torch.Tensor) -> torch.Tensor:
        """An extend step's tokens as rows (`paged_rows_attention`), split by the padded size as the
        step's graph (`extend_row_graphs`) plans them, so eager and graph steps reduce alike."""
        assert meta.decode_rows is not None
        table, lens, seqs = meta.decode_rows
        n = table.shape[0]
        splits = rows_num_splits(meta.split_rows or n, q.shape[1], k_cache.shape[2], self._sms(q.device))
        paged_rows_attention(q[:n], k_cache, v_cache, table, lens, seqs, out[:n], self.scale, splits)
        return out

    def decode_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                    meta: AttentionMetadata, out: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                    num_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> bool:
        """A decode step's rotary, KV write and attention in one kernel (`paged_decode_rope`);
        False (nothing done) where that does not apply: not a decode step, a batch bucket under
        `ROPE_FUSED_FROM_ROWS`, or switched off (`MMPIPE_DISABLE=decode-rope-fusion`). Chosen by the
        bucket, so an eager step and its graph take the same path."""
        rows = meta.split_rows or qkv.shape[0]
        if (not meta.is_decode or meta.extend_rows or rows < ROPE_FUSED_FROM_ROWS
                or not settings.current().decode_rope_fused):
            return False
        k_cache, v_cache = cache
        splits = decode_num_splits(rows, k_cache.shape[2], self._sms(qkv.device))
        paged_decode_rope(qkv, cos, sin, slot_mapping, k_cache, v_cache, meta.page_table, meta.seq_lens, out,
                          self.scale, splits, num_heads, q_norm, k_norm, eps)
        return True

    def _sms(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._num_sms[index]

    def rows_fit(self, max_query_len: int, max_seq_len: int, sequences: int, heads: int,
                 device: torch.device) -> bool:
        """At most DECODE_ROWS_UP_TO query tokens per sequence over a context of at least
        DECODE_ROWS_FROM_CONTEXT, with fewer extend programs than SMs; not with
        `MMPIPE_DISABLE=extend-decode-rows`."""
        if max_query_len > DECODE_ROWS_UP_TO or not settings.current().extend_decode_rows:
            return False
        return max_seq_len >= DECODE_ROWS_FROM_CONTEXT and sequences * heads < self._sms(device)

    def _use_varlen(self, dtype: torch.dtype, meta: AttentionMetadata) -> bool:
        if dtype not in (torch.float16, torch.bfloat16) or not self._varlen or self.extend == "triton":
            return False
        return self.extend == "varlen" or meta.max_seq_len >= VARLEN_FROM_CONTEXT

    def _varlen_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, n: int) -> None:
        if k.shape[1] != q.shape[1]:  # equal head counts, as varlen_attn in torch 2.11 required
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        # causal, aligned so the last query sees the last key (the cached prefix comes first)
        out[:n] = flash_varlen(q[:n], k, v, cu_q, cu_k, max_q, max_k, causal=True, scale=self.scale)


def gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's whole context (prefix + new) as contiguous [sum(seq_lens), Hkv, D] K/V."""
    device = meta.seq_lens.device
    page_size = k_cache.shape[1]
    lens = meta.seq_lens.long()
    total = sum(meta.seq_lens_host)
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=device)
    cu[1:] = lens.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens, output_size=total)
    pos = torch.arange(total, device=device) - cu[:-1].long()[seq]
    slots = meta.page_table.long()[seq, pos // page_size] * page_size + pos % page_size
    heads, dim = k_cache.shape[-2:]
    keys = k_cache.view(-1, heads, dim).index_select(0, slots)
    values = v_cache.view(-1, heads, dim).index_select(0, slots)
    return keys, values, cu
