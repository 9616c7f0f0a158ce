"""Whole-forward CUDA graphs for short extends over long cached contexts: the step's query tokens
run as rows.

A request whose prompt is mostly cached (a chat's next turn, a repeated request) leaves a prefill
step of a few tokens over a context of thousands. In the piecewise prefill its attention runs
eagerly between the pieces, layer after layer, and the host's launches take longer than the
kernels. Such a step's attention can run as rows, one per query token (its sequence's page table,
the keys up to itself, its sequence): `language/attention/metadata.decode_rows`, attended by the
rows kernel (`kernels/rows_attention`). That kernel needs no host lengths, so the whole forward
(pieces and attention) is captured once per small schedule size and replayed like a decode step.

The graph reads the prefill runner's fixed buffers (embeddings, positions, KV slots, deepstack)
and three of its own, filled before each replay: `table [rows, max_pages]` (each row's page
table), `lens [rows]` (the keys each row sees) and `seqs [rows]` (each row's sequence; padding
rows -1, which the kernel skips; their outputs are dropped). Rotary and the KV write run before
attention as their own kernel: the rows of one sequence see each other's new keys.

The backend decides which steps run as rows (`runs_as_rows`), the same decision its eager path
takes, and the split count follows the graph's size in both, so a step's attention reduces alike
with and without the graph. Sizes are captured at start-up only; a size without a graph, or a
step that does not qualify, takes the piecewise path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from mmpipe.language.attention import AttentionMetadata
from mmpipe.language.kv_cache import DUMMY_PAGE, KVCache

from mmpipe.graphs.memory import GraphMemory
from mmpipe.graphs.runner import GraphRunner
from mmpipe.layers.context import ForwardContext, forward_context

ROW_GRAPH_MAX_TOKENS = 64  # the largest prefill step captured as rows


class RowGraphs(GraphRunner):
    """Graphs keyed by schedule size (<= `ROW_GRAPH_MAX_TOKENS`). `forward_rows(size)` is the
    prefill runner's eager forward over its fixed buffers."""

    def __init__(self, lm: Any, kv: KVCache, device: torch.device, sizes: Sequence[int], max_pages: int,
                 forward_rows: Callable[[int], torch.Tensor], slots: torch.Tensor, wanted: bool,
                 memory: GraphMemory | str = "shared") -> None:
        super().__init__("prefill rows", device, [s for s in sizes if s <= ROW_GRAPH_MAX_TOKENS], wanted,
                         lm.attention, memory, max_graphs=None)
        if self.cache is not None:  # the prefill pieces' memory, borrowed: theirs to close
            self.cache.owns_memory = False
        self.lm, self.kv, self.forward_rows = lm, kv, forward_rows
        rows = self.sizes[-1] if self.sizes else 1
        self.table = torch.full((rows, max(1, max_pages)), DUMMY_PAGE, dtype=torch.int32, device=device)
        self.lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.seqs = torch.full((rows,), -1, dtype=torch.int32, device=device)  # each row's sequence; < 0: padding
        self.real_rows = 0  # rows from here on hold padding values (lens 1, seqs -1)
        self.slots = slots
        self.runs = 0

    def startup_keys(self) -> list[Any]:
        return sorted(self.sizes, reverse=True) if self.cache is not None else []

    def meta(self, size: int) -> AttentionMetadata:
        """What the graph's attention reads: views of the fixed buffers, no host lengths."""
        return AttentionMetadata(
            is_decode=True, num_tokens=size, slot_mapping=self.slots[:size], seq_lens=self.lens[:size],
            query_start_loc=None, page_table=self.table[:size], seq_lens_host=None, query_lens_host=None,
            max_query_len=1, max_seq_len=None, seq_len_bound=self.table.shape[1] * self.kv.page_size,
            split_rows=size, extend_rows=True, decode_rows=(self.table[:size], self.lens[:size], self.seqs[:size]))

    def body(self, key: Any) -> Callable[[], torch.Tensor]:
        meta = self.meta(key)

        def forward() -> torch.Tensor:
            with forward_context(ForwardContext(meta, self.kv.layers, self.lm.attention)):
                return self.forward_rows(key)
        return forward

    def capture(self, key: Any, quiet: bool = False) -> bool:
        self.lens.fill_(1)  # the warm-up and the capture: padding rows alone
        self.table[:, 0].fill_(DUMMY_PAGE)
        self.seqs.fill_(-1)
        self.real_rows = 0
        return super().capture(key, quiet)

    def replay(self, key: Any) -> Any | None:
        """The graph of `key`, never captured here: captures happen at start-up only (a capture
        now would run a forward over the step's slots)."""
        return self.cache.replay_key(key) if self.cache is not None and key in self.cache else None

    def label(self, key: Any) -> str:
        return f"prefill of {key} tokens as rows"

    def serves(self, n: int, meta: AttentionMetadata, heads: int) -> int | None:
        """The captured size that runs this step of `n` tokens as rows, or None."""
        if self.cache is None or meta.decode_rows is None or n > ROW_GRAPH_MAX_TOKENS:
            return None
        size = self.size_for(n)
        if size is None or size not in self.cache or meta.decode_rows[0].shape[1] > self.table.shape[1]:
            return None
        return size if self.lm.attention.runs_as_rows(meta, heads, self.device) else None

    def run_rows(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """Fill the row buffers from the step's rows and replay; hidden states [size, hidden]."""
        assert self.cache is not None and meta.decode_rows is not None
        table, lens, seqs = meta.decode_rows
        n, width = table.shape
        filled, self.real_rows = self.real_rows, max(self.real_rows, n)  # rows that may hold real values
        self.table[:n, :width].copy_(table)
        self.lens[:n].copy_(lens)
        self.seqs[:n].copy_(seqs)
        if n < filled:  # rows an earlier step filled become padding again: skipped by the rows kernel
            # (a reference backend reads one key of each)
            self.seqs[n:filled].fill_(-1)
            self.lens[n:filled].fill_(1)
        self.real_rows = n
        self.runs += 1
        self.counts.graph_runs += 1
        return self.cache.replay_key(size)

    def detail(self) -> dict[str, Any]:
        return {"row_graph_runs": self.runs}
