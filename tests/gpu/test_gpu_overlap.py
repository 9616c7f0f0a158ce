"""The overlap equivalence cases (tests/overlap_cases.py) on CUDA, where overlap is real: step N+1's graphs are
launched while step N runs, and step N's tokens are copied out of the graph's output buffers
before the next replay overwrites them. float32 with every graph mode on (the default,
full_and_piecewise): tokens identical with overlap on and off."""

from __future__ import annotations

import pytest

from mmpipe import Pipeline
from tests.overlap_cases import (  # noqa: F401 (collected here)
    test_greedy_seeded_and_logprobs_are_identical,
    test_overlap_launches_the_next_step_before_reading_tokens,
    test_stops_end_at_the_same_token,
    test_streaming_deltas_and_abort,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pipes(checkpoint):
    made = {flag: Pipeline.from_pretrained(checkpoint, device="cuda", dtype="float32",
                                           num_kv_pages=2048, overlap_schedule=flag) for flag in (False, True)}
    assert made[True].stats()["decode"]["graphs"] > 0  # the graph path is the one under test
    yield made
    for pipe in made.values():
        pipe.close()


def test_overlap_is_the_default_on_cuda(checkpoint):
    with Pipeline.from_pretrained(checkpoint, device="cuda", dtype="float32", num_kv_pages=256) as pipe:
        assert pipe.engine.overlap
