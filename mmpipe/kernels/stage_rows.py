"""The prefill forward's fixed input rows, filled by one kernel.

Before its first piece replays, a prefill step of T tokens run at a schedule size S >= T needs:
the token embeddings in `input_embeds[:T]`, the M-RoPE positions in `positions[:T]` (token-major
[max_tokens, 3]), the KV slots in `slots[:T]` and the dummy slot in `slots[T:S]` (padding rows
write their K/V to the dummy page). As separate operations (an embedding gather, two copies and a
fill) that is four launches of host time on the critical path of every request's first token;
`stage_rows` does it in one. T is read from a device scalar, so the launch is the same for every
T (a launcher that keys on integer arguments never meets a new T). Results equal the separate
operations bit for bit (it only moves values); `stage_rows_reference` is those operations.
"""

from __future__ import annotations

import torch

from mmpipe.kernels import tl, triton
from mmpipe.kernels.launch import launch, next_power_of_2


def stage_rows_reference(table: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, embeds: torch.Tensor, positions_buf: torch.Tensor,
                         slots_buf: torch.Tensor, size: int, dummy_slot: int) -> None:
    """The separate operations: gather, copies, fill. `positions` is token-major [T, 3]."""
    n = token_ids.shape[0]
    torch.index_select(table, 0, token_ids, out=embeds[:n])
    positions_buf[:n].copy_(positions)
    slots_buf[:n].copy_(slot_mapping)
    slots_buf[n:size].fill_(dummy_slot)


def stage_rows(table: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               count: torch.Tensor | None, embeds: torch.Tensor, positions_buf: torch.Tensor,
               slots_buf: torch.Tensor, size: int, dummy_slot: int) -> None:
    """Rows [0, size) of the fixed buffers for a step of T = len(token_ids) <= size tokens:
    embeddings of `token_ids` (rows of `table`), `positions` (token-major [T, 3], as the buffer),
    `slot_mapping`, the dummy slot past T. `count` is a device int64 [1] holding
    T (None: the separate operations run)."""
    n = token_ids.shape[0]
    if n > size or size > embeds.shape[0]:
        raise ValueError(f"stage_rows: {n} tokens in {size} rows of a {embeds.shape[0]}-row buffer")
    if tuple(positions.shape) != (n, 3):  # the kernel would read an M-RoPE [3, T] as rows
        raise ValueError(f"stage_rows: positions must be token-major [{n}, 3], got {tuple(positions.shape)}")
    if (triton is None or count is None or not embeds.is_cuda or not positions.is_contiguous()
            or table.stride(1) != 1 or embeds.stride(1) != 1 or not positions_buf.is_contiguous()
            or positions_buf.shape[1] != 3 or not token_ids.is_contiguous() or not slot_mapping.is_contiguous()):
        stage_rows_reference(table, token_ids, positions, slot_mapping, embeds, positions_buf, slots_buf, size,
                             dummy_slot)
        return
    stage_rows_triton(table, token_ids, positions, slot_mapping, count, embeds, positions_buf, slots_buf, size,
                      dummy_slot)


def stage_rows_triton(table: torch.Tensor, token_ids: torch.Tensor, pos_rows: torch.Tensor,
                      slot_mapping: torch.Tensor, count: torch.Tensor, embeds: torch.Tensor,
                      positions_buf: torch.Tensor, slots_buf: torch.Tensor, size: int, dummy_slot: int) -> None:
    """The kernel (`pos_rows` token-major [T, 3]; every tensor contiguous in its rows)."""
    hidden = table.shape[1]
    if size:
        launch(_stage_kernel, (size,), count, token_ids, pos_rows, slot_mapping, table, embeds, positions_buf,
               slots_buf, hidden, table.stride(0), embeds.stride(0), dummy_slot,
               BLOCK=min(1024, next_power_of_2(hidden)), num_warps=4)


if triton is not None:

    @triton.jit
    def copy_embedding_row(table_ptr, token, stride_table, embeds_ptr, row, stride_embeds, hidden,
                           BLOCK: tl.constexpr):
        """Row `token` of the embedding table into row `row` of the embeddings buffer."""
        offs = tl.arange(0, BLOCK)
        for start in range(0, hidden, BLOCK):
            mask = start + offs < hidden
            values = tl.load(table_ptr + token * stride_table + start + offs, mask=mask)
            tl.store(embeds_ptr + row * stride_embeds + start + offs, values, mask=mask)

    @triton.jit
    def copy_position_and_slot(pos_ptr, slots_ptr, pos_buf_ptr, slot_buf_ptr, row):
        """A token's three M-RoPE positions (token-major) and its KV slot into the fixed rows."""
        three = tl.arange(0, 4)
        in_row = three < 3
        tl.store(pos_buf_ptr + row * 3 + three, tl.load(pos_ptr + row * 3 + three, mask=in_row), mask=in_row)
        tl.store(slot_buf_ptr + row, tl.load(slots_ptr + row))

    @triton.jit
    def _stage_kernel(count_ptr, ids_ptr, pos_ptr, slots_ptr, table_ptr, embeds_ptr, pos_buf_ptr, slot_buf_ptr,
                      hidden, stride_table, stride_embeds, dummy_slot, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        n = tl.load(count_ptr)
        if row < n:
            token = tl.load(ids_ptr + row).to(tl.int64)
            copy_embedding_row(table_ptr, token, stride_table, embeds_ptr, row, stride_embeds, hidden, BLOCK)
            copy_position_and_slot(pos_ptr, slots_ptr, pos_buf_ptr, slot_buf_ptr, row)
        else:
            tl.store(slot_buf_ptr + row, dummy_slot)
