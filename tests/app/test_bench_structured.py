"""`mmpipe bench structured`'s parts on the CPU: the full-size tokenizer it times grammars with,
and one timed batch (half its rows held to the schema, which never lets them end early)."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from mmpipe.app.bench import structured
from mmpipe.app.tiny.synthetic import QWEN_SPECIAL_TOKENS

from mmpipe import Pipeline


def test_the_full_vocabulary_tokenizer_has_the_size_asked_and_round_trips():
    tok = structured.full_vocab_tokenizer(3000)
    assert len(tok) == 3000
    assert tok.convert_tokens_to_ids(QWEN_SPECIAL_TOKENS[:3]) == [0, 1, 2]  # the synthetic tokenizer's ids
    text = '{"items": [{"name": "bolt-7", "score": 0.25, "ok": true}]}'
    assert tok.decode(tok(text)["input_ids"]) == text
    merged = [t for t in tok.get_vocab() if len(t) > 1 and not t.startswith("<|")]
    assert len(merged) == 3000 - len(QWEN_SPECIAL_TOKENS) - 256  # the rest: pieces of several bytes


def test_a_timed_batch_runs_every_row_to_the_end_and_times_the_mask_filling():
    with Pipeline.from_pretrained(device="cpu", max_running_requests=4) as pipe:
        wall, filled = structured._decode_seconds(pipe, 4, 2, 12)
        free_wall, free_filled = structured._decode_seconds(pipe, 4, 0, 12)
    assert wall > filled > 0
    assert free_wall > 0 and free_filled == 0  # no constrained row: no mask filled
