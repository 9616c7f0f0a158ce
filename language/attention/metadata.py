"""Attention metadata of one language-model forward: built from host inputs (`PrefillInputs`, or
the decode runner's device-side batch).

Two kinds of step: *extend* (prefill: each sequence adds one or more query tokens that attend
to its cached prefix and causally to each other) and *decode* (each sequence adds exactly one).
Device tensors are what kernels and captured graphs read. Host values serve eager backends and
bookkeeping so that nothing needs a device-to-host sync; inside a captured graph they are absent
(None), since a graph replays for any lengths: there only device tensors and host bounds fixed at
capture may be used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    is_decode: bool
    num_tokens: int  # query rows in the forward, padding included
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot each row's K/V is written to (padding: dummy page)
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence after this step
    query_start_loc: torch.Tensor | None  # [B + 1] int32: cumulative query lengths (None for decode)
    page_table: torch.Tensor  # [B, max_pages] int32 (padding rows: the dummy page)
    seq_lens_host: list[int] | None  # real sequences only; None inside a captured graph
    query_lens_host: list[int] | None
    max_query_len: int  # the step's real maximum (a bound inside a graph)
    max_seq_len: int | None  # the step's real maximum sequence length; None inside a graph
    # Bound that a captured kernel's grid is sized with: >= every sequence length of any replay
    # (max_model_len inside graphs). Eager steps use the real maximum. (Decode attention does not
    # need one: its grid depends on the batch only; the captured prefill pieces will.)
    seq_len_bound: int = 0
    # Decode: the batch size the split-KV count is chosen for. The padded bucket inside a graph,
    # and the same bucket when the batch runs eagerly, so eager and graph steps reduce alike.
    split_rows: int | None = None
    # An extend step's query tokens as rows: (page table [n, pages], keys seen [n] int32, sequence
    # [n] int32; < 0: a padding row), one row per real query token (`decode_rows`). Uploaded
    # with a short step's inputs, else made by the first layer that needs them; kept for the others.
    decode_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # A decode-shaped forward whose rows are an extend step's tokens (`language/extend_row_graphs`):
    # rows of one sequence read each other's new K/V, so the new K/V are written before attention,
    # never inside the attention kernel.
    extend_rows: bool = False

    def __post_init__(self) -> None:
        if not self.seq_len_bound and self.max_seq_len is not None:
            self.seq_len_bound = self.max_seq_len


class RowsDecision:
    """`runs_as_rows` for every backend: an extend step's attention runs as decode rows when the
    backend's `rows_fit` says so of its host lengths (never inside a graph, which has none)."""

    def rows_fit(self, max_query_len: int, max_seq_len: int, sequences: int, heads: int,
                 device: torch.device) -> bool:
        raise NotImplementedError

    def runs_as_rows(self, meta: AttentionMetadata, heads: int, device: torch.device) -> bool:
        """Whether this extend step's attention runs as decode rows (`heads`: query heads here)."""
        if meta.is_decode or meta.seq_lens_host is None or meta.max_seq_len is None:
            return False
        return self.rows_fit(meta.max_query_len, meta.max_seq_len, len(meta.seq_lens_host), heads, device)


def decode_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each real query token of an extend step as a row: its sequence's page-table row, the keys it
    sees (int32: its sequence's prefix, itself and the tokens before it in the step) and its
    sequence's index (int32).
    Device work only, sized from the host lengths: no sync. (`host_decode_rows` makes the same
    on the host, for a step's upload.)"""
    lens_host = meta.query_lens_host or []
    batch, total = len(lens_host), sum(lens_host)
    device = meta.seq_lens.device
    starts = meta.query_start_loc[:batch + 1].long()
    query_lens = starts[1:] - starts[:-1]
    index = torch.repeat_interleave(torch.arange(batch, device=device), query_lens, output_size=total)
    local = torch.arange(total, device=device) - starts[:-1][index]
    keys = meta.seq_lens[:batch].long()[index] - query_lens[index] + local + 1
    return meta.page_table.index_select(0, index), keys.to(torch.int32), index.to(torch.int32)


def host_decode_rows(query_lens: Sequence[int], seq_lens: Sequence[int], page_table: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`decode_rows` from a step's host inputs: (page table [n, pages], keys [n], sequence [n]), int32."""
    keys, index = row_keys(query_lens, seq_lens)
    return np.ascontiguousarray(page_table[index], dtype=np.int32), keys, index


def row_keys(query_lens: Sequence[int], seq_lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per query token of a step: the keys it sees (its sequence's cached prefix, the tokens
    before it and itself) and its sequence's index; int32 [n] each."""
    if len(query_lens) == 1:  # a single sequence (a chat turn): no repeats
        q, s = query_lens[0], seq_lens[0]
        return np.arange(s - q + 1, s + 1, dtype=np.int32), np.zeros(q, dtype=np.int32)
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    index = np.repeat(np.arange(q.shape[0]), q)
    starts = np.cumsum(q) - q
    local = np.arange(index.shape[0]) - starts[index]
    return (s[index] - q[index] + local + 1).astype(np.int32), index.astype(np.int32)
