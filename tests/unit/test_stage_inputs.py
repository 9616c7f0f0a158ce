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
