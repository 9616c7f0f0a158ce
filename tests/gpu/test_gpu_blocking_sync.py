"""Waiting for a step's tokens (`HostTokens.get`): by default (`blocking-sync` not in `MMPIPE_DISABLE`)
the engine thread sleeps between short looks while the GPU works, with it off it spins a core; the
tokens are the same, and neither returns before the GPU has written them."""

from __future__ import annotations

import time

import pytest
import torch
from mmpipe.language.host_tokens import HostTokens
from mmpipe.language.sampler import SampleResult

pytestmark = pytest.mark.gpu


def wait_behind_a_long_kernel(switch, flag: str) -> tuple[float, float, list[list[int]]]:
    """Thread CPU seconds and wall seconds of `get()` for tokens queued behind a long GPU sleep."""
    switch("blocking-sync", flag)
    tokens = torch.arange(7, device="cuda") * 3

    def one_round(cycles: int, offset: int) -> tuple[float, float, list[list[int]]]:
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        pending = HostTokens(SampleResult(tokens + offset, None, None, None), 5, logprobs=False)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        ids, _ = pending.get()
        return time.thread_time() - cpu0, time.perf_counter() - wall0, ids

    # The same round once untimed: the first such round in a process waited before `get`,
    # spinning (most likely the first launch of the `tokens + offset` kernel, loaded while the GPU
    # sleeps); later ones wait in `get` only. Its values differ from the timed round's: pinned
    # buffers are reused, so a read before the GPU wrote the timed tokens would show these.
    one_round(100_000_000, 1000)
    return one_round(600_000_000, 1)  # six times the first round: long against any host overhead


def test_the_waiting_thread_sleeps_with_blocking_sync_and_spins_without(switch):
    cpu_on, wall_on, ids_on = wait_behind_a_long_kernel(switch, "1")
    cpu_off, wall_off, ids_off = wait_behind_a_long_kernel(switch, "0")
    assert ids_on == ids_off == [[1], [4], [7], [10], [13]]
    assert wall_on > 0.05 and wall_off > 0.05, (wall_on, wall_off)  # the wait really was behind the kernel
    assert cpu_on < 0.2 * wall_on, (cpu_on, wall_on)
    assert cpu_off > 0.6 * wall_off, (cpu_off, wall_off)
