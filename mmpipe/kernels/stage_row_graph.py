"""A row graph's inputs staged inside the graph, by one kernel.

A short extend replayed as one graph (`language/extend_row_graphs`) needs, before its first
layer, the prefill's fixed rows (token embeddings, M-RoPE positions, KV slots, the dummy slot in
padding rows), the rows kernel's buffers (each row's keys, sequence and page table; padding rows:
one key, sequence -1) and the step's logit rows. Filled by a host-to-device copy and
host-launched kernels, that is several calls of host time on the critical path of a chat turn's
first token. Here the host writes the step into a fixed input region in pinned host memory, which
the GPU reads directly, and this kernel, the graph's first node, does the rest: it reads the
step's row count and page-table width from the region, so one graph serves every step.

Rows whose token id is negative keep their embedding row: an image's rows, written before the
replay. A row takes its page table from its sequence's (the region holds one per sequence).
`stage_row_graph_reference` is the same with torch operations (it reads the count on the host).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.launch import launch, next_power_of_2


class StagedStep(NamedTuple):
    """Views of the fixed input region the host writes before a replay."""

    header: torch.Tensor  # [2] int64: the step's rows n, its page-table width w
    ids: torch.Tensor  # [R] int64; < 0: keep the embedding row (an image's)
    positions: torch.Tensor  # [R, 3] int64, token-major
    slots: torch.Tensor  # [R] int64
    lens: torch.Tensor  # [R] int32: keys each row sees
    seqs: torch.Tensor  # [R] int32: each row's sequence
    logit_rows: torch.Tensor  # [R] int64: the rows whose logits the step wants, first
    tables: torch.Tensor  # [capacity] int32: the sequences' page tables, [sequences, w] row-major


class RowBuffers(NamedTuple):
    """What the graph's forward reads: the prefill's fixed rows and the rows kernel's buffers."""

    embed_table: torch.Tensor  # [vocab, hidden]
    embeds: torch.Tensor  # [max_tokens, hidden]
    positions: torch.Tensor  # [max_tokens, 3] int64
    slots: torch.Tensor  # [max_tokens] int64
    lens: torch.Tensor  # [R] int32
    seqs: torch.Tensor  # [R] int32
    table: torch.Tensor  # [R, max_pages] int32
    logit_rows: torch.Tensor  # [R] int64


def stage_row_graph(step: StagedStep, out: RowBuffers, size: int, dummy_slot: int) -> None:
    """Rows [0, size) of `out` from `step`: rows below the step's count take its values, the rest
    are padding (dummy slot, one key, sequence -1; their embeddings and positions untouched); the
    first `size` logit rows, whatever they hold."""
    if triton is None or not out.embeds.is_cuda:
        stage_row_graph_reference(step, out, size, dummy_slot)
        return
    hidden = out.embed_table.shape[1]
    launch(_stage_kernel, (size,), out.embed_table, step.header, step.ids, step.positions, step.slots, step.lens,
           step.seqs, step.logit_rows, step.tables, out.embeds, out.positions, out.slots, out.lens, out.seqs,
           out.table, out.logit_rows, hidden, out.embed_table.stride(0), out.embeds.stride(0), out.table.stride(0), dummy_slot,
           BLOCK=min(1024, next_power_of_2(hidden)), BLOCK_P=256, num_warps=4)


def stage_row_graph_reference(step: StagedStep, out: RowBuffers, size: int, dummy_slot: int) -> None:
    out.logit_rows[:size] = step.logit_rows[:size]
    n, width = (int(v) for v in step.header.tolist())
    n = min(n, size)
    ids = step.ids[:n]
    text = (ids >= 0).nonzero().flatten()
    out.embeds[text] = out.embed_table[ids[text]]
    out.positions[:n] = step.positions[:n]
    out.slots[:n] = step.slots[:n]
    out.slots[n:size] = dummy_slot
    out.lens[:n] = step.lens[:n]
    out.lens[n:size] = 1
    out.seqs[:n] = step.seqs[:n]
    out.seqs[n:size] = -1
    if n and width:
        tables = step.tables[:int(step.seqs[:n].max()) * width + width].view(-1, width)
        out.table[:n, :width] = tables[step.seqs[:n].long()]


if triton is not None:
    from mmpipe.kernels.stage_rows import copy_embedding_row, copy_position_and_slot

    @triton.jit
    def _stage_kernel(emb_ptr, header_ptr, ids_ptr, pos_ptr, slots_ptr, lens_ptr, seqs_ptr, logits_ptr, tables_ptr,
                      embeds_ptr, pos_buf_ptr, slot_buf_ptr, lens_buf_ptr, seqs_buf_ptr, table_buf_ptr, logits_buf_ptr,
                      hidden, stride_emb, stride_embeds, stride_table, dummy_slot,
                      BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tl.store(logits_buf_ptr + row, tl.load(logits_ptr + row))
        n = tl.load(header_ptr)
        if row < n:
            token = tl.load(ids_ptr + row)
            if token >= 0:
                copy_embedding_row(emb_ptr, token, stride_emb, embeds_ptr, row, stride_embeds, hidden, BLOCK)
            copy_position_and_slot(pos_ptr, slots_ptr, pos_buf_ptr, slot_buf_ptr, row)
            tl.store(lens_buf_ptr + row, tl.load(lens_ptr + row))
            seq = tl.load(seqs_ptr + row)
            tl.store(seqs_buf_ptr + row, seq)
            width = tl.load(header_ptr + 1)
            cols = tl.arange(0, BLOCK_P)
            for start in range(0, width, BLOCK_P):
                mask = start + cols < width
                pages = tl.load(tables_ptr + seq.to(tl.int64) * width + start + cols, mask=mask)
                tl.store(table_buf_ptr + row * stride_table + start + cols, pages, mask=mask)
        else:
            tl.store(slot_buf_ptr + row, dummy_slot)
            tl.store(lens_buf_ptr + row, 1)
            tl.store(seqs_buf_ptr + row, -1)
