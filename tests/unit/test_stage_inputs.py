"""The prefill's fixed input rows filled in one kernel (`mmpipe/kernels/stage_rows.py`), on the CPU:
the reference operations, the Triton kernel under the Triton interpreter (in a subprocess, since
TRITON_INTERPRET is read when a kernel is defined), and a warm-up forward after a real step
(its rows must not reuse the real step's KV slots). The kernel on CUDA: tests/gpu/test_gpu_fused.py."""

from __future__ import annotations

import textwrap

import pytest
import torch

from mmpipe.kernels.stage_rows import stage_rows
from tests.helpers import run_under_triton_interpreter, stacked_kv

DUMMY = 0


def make_case(n: int, size: int, hidden: int, rows: int = 16, vocab: int = 50, dtype=torch.float32, seed: int = 0):
    """Random table, ids, token-major positions [T, 3] and slots; buffers full of
    values that no step writes (so a row left alone is visible)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    pos_rows = torch.randint(0, 1000, (n, 3), generator=gen)
    slots = torch.randint(1, 500, (n,), generator=gen)
    embeds = torch.full((rows, hidden), -7.0, dtype=dtype)
    positions_buf = torch.full((rows, 3), -5, dtype=torch.int64)
    slots_buf = torch.full((rows,), -3, dtype=torch.int64)
    return table, ids, pos_rows, slots, embeds, positions_buf, slots_buf


def expected(table, ids, positions, slots, embeds, positions_buf, slots_buf, size):
    n = ids.shape[0]
    e, p, s = embeds.clone(), positions_buf.clone(), slots_buf.clone()
    e[:n] = table[ids]
    p[:n] = positions
    s[:n] = slots
    s[n:size] = DUMMY
    return e, p, s


@pytest.mark.parametrize("n,size", [(5, 8), (8, 8), (1, 12), (3, 3)])
def test_reference_fills_the_step_rows_and_the_dummy_slot_in_its_padding_only(n, size):
    table, ids, positions, slots, embeds, positions_buf, slots_buf = make_case(n, size, hidden=24, seed=n)
    want = expected(table, ids, positions, slots, embeds, positions_buf, slots_buf, size)
    stage_rows(table, ids, positions, slots, None, embeds, positions_buf, slots_buf, size, DUMMY)
    assert torch.equal(embeds, want[0]) and torch.equal(positions_buf, want[1]) and torch.equal(slots_buf, want[2])
    assert (slots_buf[size:] == -3).all() and (embeds[n:] == -7).all()  # rows past the step: untouched


def test_a_step_longer_than_its_rows_is_refused():
    table, ids, positions, slots, embeds, positions_buf, slots_buf = make_case(6, 4, hidden=8)
    with pytest.raises(ValueError, match="6 tokens in 4 rows"):
        stage_rows(table, ids, positions, slots, None, embeds, positions_buf, slots_buf, 4, DUMMY)


def test_axis_major_positions_are_refused():
    """M-RoPE positions are [3, T] elsewhere; here they must be token-major (a contiguous [3, T]
    would otherwise be read as rows by the kernel)."""
    table, ids, positions, slots, embeds, positions_buf, slots_buf = make_case(5, 8, hidden=8)
    with pytest.raises(ValueError, match=r"token-major \[5, 3\], got \(3, 5\)"):
        stage_rows(table, ids, positions.t().contiguous(), slots, None, embeds, positions_buf, slots_buf, 8, DUMMY)


def test_a_warmup_forward_after_a_real_step_writes_only_the_dummy_page():
    """The slots buffer keeps a real step's slots in its rows; a later warm-up (capture) forward
    over those rows must send its K/V to the dummy page, not into the real sequence's pages."""
    from tests.lm_helpers import make_runner, run, tiny_lm

    runner = make_runner(tiny_lm(), piecewise=True)
    run(runner, [(0, 10)], seed=2, first_page=1)  # pages 1 and 2 (page size 8) hold the sequence
    before = stacked_kv(runner.kv)  # [layers, 2, pages, page_size, kv_heads, head_dim]
    assert before[:, :, 1:3].abs().sum() > 0
    runner._dummy_forward(16, capture=False)
    after = stacked_kv(runner.kv)
    assert torch.equal(after[:, :, 1:], before[:, :, 1:])  # every real page unchanged
    assert not torch.equal(after[:, :, 0], before[:, :, 0])  # the warm-up wrote the dummy page (0)


_INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import json
    import torch
    from mmpipe.kernels import stage_rows as stage_inputs
    from tests.unit.test_stage_inputs import expected, make_case

    print("READY", flush=True)  # the interpreter is usable; from here on a failure is the kernel's
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, size, hidden in [(5, 8, 24), (8, 8, 24), (1, 12, 1030), (11, 16, 64)]:
            case = make_case(n, size, hidden, dtype=dtype, seed=n + hidden)
            table, ids, positions, slots, embeds, positions_buf, slots_buf = case
            want = expected(*case, size)
            count = torch.tensor([n], dtype=torch.int64)
            stage_inputs.stage_rows_triton(table, ids, positions, slots, count, embeds, positions_buf, slots_buf,
                                           size, 0)
            same = torch.equal(embeds, want[0]) and torch.equal(positions_buf, want[1]) and \
                torch.equal(slots_buf, want[2])
            results.append([str(dtype), n, size, hidden, bool(same)])
    print("RESULTS " + json.dumps(results), flush=True)
""")


def test_triton_kernel_under_interpreter():
    failed = [case for case in run_under_triton_interpreter(_INTERPRETER_SCRIPT) if not case[-1]]
    assert not failed, failed


# ---------------------------------------------------------------- a row graph's staged step

def row_graph_case(n: int, size: int, width: int, query_lens: list[int], image_rows: tuple[int, ...] = (),
                   hidden: int = 40, rows: int = 12, dtype=torch.float32, seed: int = 0):
    """A staged step (`kernels/stage_row_graph.StagedStep`) of `n` rows over len(query_lens)
    sequences with `width`-page tables, and buffers full of values no step writes."""
    from mmpipe.kernels.stage_row_graph import RowBuffers, StagedStep

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (rows,), generator=gen)
    ids[list(image_rows)] = -1
    seqs = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int32), torch.tensor(query_lens, dtype=torch.int64))
    seqs = torch.cat([seqs, torch.full((rows - n,), 9, dtype=torch.int32)])  # past n: never read
    step = StagedStep(torch.tensor([n, width]), ids, torch.randint(0, 1000, (rows, 3), generator=gen),
                      torch.randint(1, 500, (rows,), generator=gen),
                      torch.randint(1, 5000, (rows,), generator=gen, dtype=torch.int32), seqs,
                      torch.randint(0, 64, (rows,), generator=gen),
                      torch.randint(1, 900, (len(query_lens) * width + 17,), generator=gen, dtype=torch.int32))
    out = RowBuffers(torch.randn(50, hidden, generator=gen).to(dtype), torch.full((rows + 4, hidden), -7.0, dtype=dtype),
                     torch.full((rows + 4, 3), -5, dtype=torch.int64), torch.full((rows + 4,), -3, dtype=torch.int64),
                     torch.full((rows,), -2, dtype=torch.int32), torch.full((rows,), -4, dtype=torch.int32),
                     torch.full((rows, width + 5), -6, dtype=torch.int32), torch.full((rows,), -8, dtype=torch.int64))
    return step, out


def row_graph_expected(step, out, size: int, dummy: int):
    """Row by row, as the module docstring says."""
    want = [t.clone() for t in out]
    n, width = step.header.tolist()
    want[7][:size] = step.logit_rows[:size]
    for r in range(size):
        if r < n:
            if step.ids[r] >= 0:
                want[1][r] = out.embed_table[step.ids[r]]
            want[2][r], want[3][r], want[4][r], want[5][r] = step.positions[r], step.slots[r], step.lens[r], step.seqs[r]
            s = int(step.seqs[r])
            want[6][r, :width] = step.tables[s * width:(s + 1) * width]
        else:
            want[3][r], want[4][r], want[5][r] = dummy, 1, -1
    return want


ROW_GRAPH_CASES = [  # n, size, width, query lens, image rows
    (5, 8, 300, [3, 2], (1,)), (8, 8, 3, [8], ()), (1, 4, 1, [1], ()), (0, 8, 7, [], ()), (6, 12, 260, [1, 4, 1], (2, 3))]


@pytest.mark.parametrize("n,size,width,query_lens,image_rows", ROW_GRAPH_CASES)
def test_row_graph_reference_stages_the_step_then_padding_and_keeps_image_rows(n, size, width, query_lens, image_rows):
    from mmpipe.kernels.stage_row_graph import stage_row_graph

    step, out = row_graph_case(n, size, width, query_lens, image_rows, seed=n + width)
    want = row_graph_expected(step, out, size, DUMMY)
    stage_row_graph(step, out, size, DUMMY)
    for name, got, expect in zip(out._fields, out, want):
        assert torch.equal(got, expect), name


_ROW_GRAPH_INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import torch
    import json
    from mmpipe.kernels import stage_row_graph as module
    from tests.unit.test_stage_inputs import ROW_GRAPH_CASES, row_graph_case, row_graph_expected

    print("READY", flush=True)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, size, width, query_lens, image_rows in ROW_GRAPH_CASES:
            step, out = row_graph_case(n, size, width, query_lens, image_rows, hidden=1030, dtype=dtype, seed=n)
            want = row_graph_expected(step, out, size, 0)
            module.launch(module._stage_kernel, (size,), out.embed_table, step.header, step.ids, step.positions,
                          step.slots, step.lens, step.seqs, step.logit_rows, step.tables, out.embeds, out.positions,
                          out.slots, out.lens, out.seqs, out.table, out.logit_rows, 1030, out.embed_table.stride(0),
                          out.embeds.stride(0), out.table.stride(0), 0, BLOCK=1024, BLOCK_P=256, num_warps=4)
            wrong = [name for name, got, expect in zip(out._fields, out, want) if not torch.equal(got, expect)]
            results.append([str(dtype), n, size, width, wrong])
    print("RESULTS " + json.dumps(results), flush=True)
""")


def test_row_graph_staging_kernel_under_interpreter():
    failed = [case for case in run_under_triton_interpreter(_ROW_GRAPH_INTERPRETER_SCRIPT) if case[-1]]
    assert not failed, failed


def test_input_region_holds_a_step_of_two_sequences_with_image_rows_marked():
    """`InputRegion.write`: ids (an image's rows -1, the caller's array untouched), token-major
    positions, slots, logit rows, the count and table width, each row's keys and sequence, and
    the sequences' page tables row-major; what the staging kernel reads."""
    import numpy as np
    from mmpipe.language.extend_row_graphs import InputRegion

    from mmpipe.step_io import ImageSpan, PrefillInputs

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 500, 7)
    positions = rng.integers(0, 900, (3, 7))
    table = rng.integers(1, 99, (2, 5)).astype(np.int32)
    inputs = PrefillInputs(ids, positions, rng.integers(0, 900, 7), [40, 12], [4, 3], table, np.array([3, 6]),
                           [ImageSpan(4, torch.zeros(2, 8))])
    region = InputRegion(8, 6, torch.device("cpu"))
    region.write(inputs)
    step = region.step
    assert step.header.tolist() == [7, 5]
    assert step.ids[:7].tolist() == ids[:4].tolist() + [-1, -1] + ids[6:].tolist() and ids.min() >= 0
    assert step.positions[:7].tolist() == positions.T.tolist() and step.slots[:7].tolist() == inputs.slot_mapping.tolist()
    assert step.logit_rows[:2].tolist() == [3, 6]
    assert step.lens[:7].tolist() == [37, 38, 39, 40, 10, 11, 12] and step.seqs[:7].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert step.tables[:10].tolist() == table.flatten().tolist()
    again = InputRegion(8, 6, torch.device("cpu"))  # other integer types: written as the slots' types
    again.write(PrefillInputs(ids.astype(np.int32), positions.astype(np.int32), inputs.slot_mapping, [40, 12], [4, 3],
                              table.astype(np.int64), np.array([3, 6], dtype=np.int32), inputs.images))
    assert torch.equal(again.buffer, region.buffer)
