"""Attention metadata of one language-model forward, built on the host by the model runner.

Two kinds of step: *extend* (prefill: each sequence adds one or more query tokens that attend
to its cached prefix and causally to each other) and *decode* (each sequence adds exactly one).
Device tensors are what kernels and captured graphs read; host mirrors serve eager backends and
bookkeeping so that nothing needs a device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    is_decode: bool
    num_tokens: int  # real query tokens (rows past this are padding)
    slot_mapping: torch.Tensor  # [T_pad] int64: flat KV slot each query token's K/V is written to
    seq_lens: torch.Tensor  # [B_pad] int32: KV length of each sequence after this step (0 = padding row)
    query_start_loc: torch.Tensor  # [B_pad + 1] int32: cumulative query lengths
    page_table: torch.Tensor  # [B_pad, max_pages] int32
    seq_lens_host: list[int]  # real sequences only
    query_lens_host: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)
