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
and three of its own, filled for each step: `table [rows, max_pages]` (each row's page
table), `lens [rows]` (the keys each row sees) and `seqs [rows]` (each row's sequence; padding
rows -1, which the kernel skips; their outputs are dropped). Rotary and the KV write run before
attention as their own kernel: the rows of one sequence see each other's new keys.

The step's inputs reach the graph through a fixed input region in pinned host memory
(`InputRegion`), which the GPU reads directly: the host writes the step there and the graph's
first kernel (`kernels/stage_row_graph`) fills the fixed rows, the three buffers and the logit
rows from it, so a replay costs one launch and no copy. The host writes the region again only
once the last replay has read it (an event each graph records after its staging kernel). A
tensor-parallel shard, whose embedding lookup sums the ranks' rows, fills them before the replay
instead (`run_rows`).

The backend decides which steps run as rows (`runs_as_rows`; from host lengths alone,
`rows_fit`), the same decision its eager path takes, and the split count follows the graph's size
in both, so a step's attention reduces alike with and without the graph. Sizes are captured at
start-up only; a size without a graph, or a step that does not qualify, takes the piecewise path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mmpipe.language.attention import AttentionMetadata
from mmpipe.language.attention.metadata import row_keys
from mmpipe.language.kv_cache import DUMMY_PAGE, KVCache

from mmpipe.graphs.memory import GraphMemory
from mmpipe.graphs.runner import GraphRunner
from mmpipe.kernels.stage_row_graph import RowBuffers, StagedStep, stage_row_graph
from mmpipe.layers.context import ForwardContext, forward_context
from mmpipe.step_io import PrefillInputs

ROW_GRAPH_MAX_TOKENS = 64  # the largest prefill step captured as rows


class InputRegion:
    """A row graph step's inputs at fixed offsets of one host buffer (`rows` rows; page tables last,
    as many as the step has), pinned on CUDA, where the graph's staging kernel reads it directly."""

    def __init__(self, rows: int, max_pages: int, device: torch.device) -> None:
        self.offsets: dict[str, int] = {}
        at = 0
        for name, nbytes in (("ids", 8 * rows), ("positions", 24 * rows), ("slots", 8 * rows),
                             ("logit_rows", 8 * rows), ("header", 16), ("lens", 4 * rows), ("seqs", 4 * rows)):
            self.offsets[name] = at
            at += -(-nbytes // 16) * 16
        self.offsets["tables"] = at
        total = at + -(-4 * rows * max_pages // 16) * 16  # a table per sequence, at most one per row
        self.buffer = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        wide, narrow = self.buffer.view(torch.int64), self.buffer.view(torch.int32)
        self.typed = {np.dtype(np.int64): wide.numpy(), np.dtype(np.int32): narrow.numpy()}

        def part(name: str, view: torch.Tensor, count: int) -> torch.Tensor:
            start = self.offsets[name] // view.element_size()
            return view[start:start + count]
        self.step = StagedStep(part("header", wide, 2), part("ids", wide, rows),
                               part("positions", wide, 3 * rows).view(rows, 3), part("slots", wide, rows),
                               part("lens", narrow, rows), part("seqs", narrow, rows),
                               part("logit_rows", wide, rows), narrow[at // 4:])

    def write(self, inputs: PrefillInputs) -> None:
        """The step's inputs into the buffer (a graph that read it before must have done so)."""
        ids = inputs.token_ids
        if inputs.images:  # their rows keep the embeddings written before the replay
            ids = ids.copy()
            for span in inputs.images:
                ids[span.row:span.row + span.values.shape[0]] = -1
        lens, seqs = row_keys(inputs.query_lens, inputs.seq_lens)
        table = inputs.page_table
        header = np.array([ids.shape[0], table.shape[1]], dtype=np.int64)
        at = self.offsets
        parts = (("ids", ids, np.int64), ("positions", inputs.positions.T, np.int64),
                 ("slots", inputs.slot_mapping, np.int64), ("logit_rows", inputs.logit_rows, np.int64),
                 ("header", header, np.int64), ("lens", lens, np.int32), ("seqs", seqs, np.int32),
                 ("tables", table, np.int32))
        for name, array, dtype in parts:
            array = np.asarray(array, dtype=dtype)  # the slot's type (no copy when it has it)
            start = at[name] // array.itemsize
            self.typed[array.dtype][start:start + array.size].reshape(array.shape)[...] = array


class RowGraphs(GraphRunner):
    """Graphs keyed by schedule size (<= `ROW_GRAPH_MAX_TOKENS`). `forward_rows(size)` is the
    prefill runner's eager forward over its fixed buffers; `fixed_rows`, its embeddings and
    positions buffers, which the graphs stage themselves (None: the caller fills them, and every
    step goes through `run_rows`)."""

    def __init__(self, lm: Any, kv: KVCache, device: torch.device, sizes: Sequence[int], max_pages: int,
                 forward_rows: Callable[[int], torch.Tensor], slots: torch.Tensor, wanted: bool,
                 memory: GraphMemory | str = "shared",
                 fixed_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
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
        self.region: InputRegion | None = None
        self.consumed: torch.cuda.Event | None = None  # recorded by a replay once it read the region
        if fixed_rows is not None and self.cache is not None:
            self.region = InputRegion(rows, max(1, max_pages), device)
            self.buffers = RowBuffers(lm.embed_tokens.weight, *fixed_rows, slots, self.lens, self.seqs, self.table,
                                      torch.zeros(rows, dtype=torch.int64, device=device))
            self.dummy_slot = kv.dummy_slot
            if device.type == "cuda":
                self.consumed = torch.cuda.Event(external=True)  # a node of each graph

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
            if self.region is not None:
                stage_row_graph(self.region.step, self.buffers, key, self.dummy_slot)
                if self.consumed is not None:
                    self.consumed.record()
            with forward_context(ForwardContext(meta, self.kv.layers, self.lm.attention)):
                return self.forward_rows(key)
        return forward

    def capture(self, key: Any, quiet: bool = False) -> bool:
        self.lens.fill_(1)  # the warm-up and the capture: padding rows alone
        self.table[:, 0].fill_(DUMMY_PAGE)
        self.seqs.fill_(-1)
        self.real_rows = 0
        if self.region is not None:
            if self.consumed is not None:
                self.consumed.synchronize()  # a replay still queued reads the region
            self.region.step.header.zero_()  # a step of no rows: all padding, K/V to the dummy page
        return super().capture(key, quiet)

    def replay(self, key: Any) -> Any | None:
        """The graph of `key`, never captured here: captures happen at start-up only (a capture
        now would run a forward over the step's slots)."""
        return self.cache.replay_key(key) if self.cache is not None and key in self.cache else None

    def label(self, key: Any) -> str:
        return f"prefill of {key} tokens as rows"

    def staged_size(self, inputs: PrefillInputs, heads: int) -> int | None:
        """The captured size that runs this step as rows, staging its inputs itself, or None."""
        n = inputs.token_ids.shape[0]
        if self.cache is None or self.region is None or not 0 < n <= ROW_GRAPH_MAX_TOKENS:
            return None
        longest = max(inputs.seq_lens)
        size = self.size_for(n)
        if longest <= n or size is None or size not in self.cache or inputs.page_table.shape[1] > self.table.shape[1]:
            return None
        fits = self.lm.attention.rows_fit(max(inputs.query_lens), longest, len(inputs.seq_lens), heads, self.device)
        return size if fits else None

    def run_staged(self, size: int, inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step into the input region and replay the size's graph; hidden states
        [size, hidden] and the step's logit rows, on the device."""
        assert self.region is not None and self.cache is not None
        if self.consumed is not None:
            self.consumed.synchronize()  # the last replay has read the region (long done, normally)
        self.region.write(inputs)
        self.runs += 1
        self.counts.graph_runs += 1
        return self.cache.replay_key(size), self.buffers.logit_rows[:inputs.logit_rows.shape[0]]

    def serves(self, n: int, meta: AttentionMetadata, heads: int) -> int | None:
        """The captured size that runs this step of `n` tokens as rows after the caller filled
        the fixed rows (`run_rows`), or None (always None where the graphs stage their inputs)."""
        if self.cache is None or self.region is not None or meta.decode_rows is None or n > ROW_GRAPH_MAX_TOKENS:
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
