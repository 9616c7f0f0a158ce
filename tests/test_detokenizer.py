"""Incremental detokenisation: never broken characters, never text a stop string later removes."""

from __future__ import annotations

from mmpipe.engine.detokenizer import IncrementalDetokenizer
from tests.helpers import make_tokenizer

TEXT = "héllo wörld ✓ 🙂 日本語, a small green triangle at the bottom 🙂🙂"


def feed(detok, ids, streamed):
    for token in ids:
        detok.add(token)
        streamed.append(detok.pop_delta())


def test_incremental_text_equals_full_decode_without_broken_characters():
    tok = make_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT) // 3  # multi-byte characters really are split across tokens
    detok = IncrementalDetokenizer(tok)
    streamed: list[str] = []
    feed(detok, ids, streamed)
    detok.finish()
    streamed.append(detok.pop_delta(final=True))
    assert "".join(streamed) == TEXT == detok.text
    assert all("\ufffd" not in piece for piece in streamed)


def test_special_tokens_are_skipped():
    tok = make_tokenizer()
    ids = tok("ab", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(tok)
    for token in ids:
        detok.add(token)
    assert detok.text == "ab"


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    tok = make_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, stop=["green tri"])
    streamed: list[str] = []
    for token in ids:
        detok.add(token)
        streamed.append(detok.pop_delta())
        if detok.stopped:
            break
    streamed.append(detok.pop_delta(final=True))
    assert detok.stopped
    assert detok.text == TEXT[:TEXT.index("green tri")]
    assert "".join(streamed) == detok.text


def test_incomplete_character_at_the_end_is_flushed():
    tok = make_tokenizer()
    ids = tok("ok 🙂", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    for token in ids[:-1]:  # cut inside the emoji's bytes
        detok.add(token)
    assert "\ufffd" not in detok.text
    detok.finish()
    assert detok.text.startswith("ok ") and detok.text.endswith("\ufffd")
