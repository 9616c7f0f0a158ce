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


def test_fast_decode_equals_the_tokenizers_decode():
    from mmpipe.engine.detokenizer import fast_decode

    tok = make_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    decode = fast_decode(tok)
    assert decode is not tok.decode
    for cut in (1, 3, 7, len(ids) - 1, len(ids)):
        for skip in (True, False):
            assert decode(ids[:cut], skip_special_tokens=skip) == tok.decode(ids[:cut], skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True  # transformers would post-process: keep its decode
    assert fast_decode(tok) == tok.decode


def test_decode_all_equals_feeding_every_token():
    tok = make_tokenizer()
    ids = tok("ok 🙂 日本語 🙂", add_special_tokens=False)["input_ids"]
    for cut in (len(ids), len(ids) - 1):  # the second ends inside an emoji's bytes
        fed = IncrementalDetokenizer(tok)
        for token in ids[:cut]:
            fed.add(token)
        fed.finish()
        once = IncrementalDetokenizer(tok)
        once.decode_all(ids[:cut])
        once.finish()
        assert once.text == fed.text and once.pop_delta(final=True) == fed.text
    try:
        IncrementalDetokenizer(tok, stop=["x"]).decode_all(ids)
    except RuntimeError:
        pass
    else:
        raise AssertionError("decode_all must refuse stop strings")


def test_final_text_of_a_non_streaming_request_decodes_once(pipe):
    """A caption's text is made with one decode call at the end, not two per token (host time
    that grows with every caption)."""
    from mmpipe import SamplingParams

    request = pipe.processor.build(0, *pipe.processor.render_chat([{"role": "user", "content": "hi"}], "t"),
                                   SamplingParams(max_new_tokens=40, ignore_eos=True), "t")
    assert not request.incremental_text
    calls = []
    decode = request.detokenizer._decode
    request.detokenizer._decode = lambda ids, **kw: calls.append(1) or decode(ids, **kw)
    ids = make_tokenizer()(TEXT, add_special_tokens=False)["input_ids"][:40]
    for token in ids:
        request.append_token(token, None)
    assert request.finished
    assert request.to_output().text == decode(ids, skip_special_tokens=True)
    assert len(calls) == 1
