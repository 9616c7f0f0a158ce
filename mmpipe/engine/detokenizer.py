"""Incremental detokenisation with stop strings.

Text is produced from a sliding window of tokens so each step decodes a handful of tokens, not
the whole output; a byte-level token that ends inside a UTF-8 character yields nothing until the
character is complete, so deltas never contain broken characters. Stop strings are searched only
where new text could complete one; the text from a stop string on is removed. For streaming,
`pop_delta` holds back the last `max(len(stop)) - 1` characters until they can no longer begin
a stop string, so nothing emitted is ever taken back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

_REPLACEMENT = "\ufffd"


def fast_decode(tokenizer: Any) -> Callable[..., str]:
    """`tokenizer.decode`, minus transformers' per-call conversion of its arguments (most of the
    time of every decode call), where the result is the same: a `tokenizers` backend and no
    clean-up of tokenization spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode

    def decode(ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    return decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self._decode = fast_decode(tokenizer)
        self._skip = skip_special_tokens
        self.stop = tuple(stop)
        self.min_tokens = min_tokens  # stop strings are not looked for before this many tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens before this index are already in `text`
        self._emitted = 0
        self.stopped = False  # a stop string was found; `text` ends before it

    def add(self, token_id: int) -> None:
        """Append one generated token and extend `text`."""
        if self.stopped:
            return
        self.tokens.append(int(token_id))
        window = self.tokens[self._prefix:]
        prefix_text = self._decode(self.tokens[self._prefix:self._read], skip_special_tokens=self._skip)
        full_text = self._decode(window, skip_special_tokens=self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return  # an incomplete character, or a skipped special token: wait for more
        delta = full_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.tokens)
        self._append(delta)

    def decode_all(self, tokens: Sequence[int]) -> None:
        """The whole output at once, for a request that needed no text until it finished: one
        decode instead of two per token (the same text when there are no stop strings)."""
        if self.stop or self.tokens:
            raise RuntimeError("decode_all is for a detokenizer without stop strings that was never fed")
        self.tokens = [int(t) for t in tokens]
        self.text = self._decode(self.tokens, skip_special_tokens=self._skip)
        self._prefix = self._read = len(self.tokens)

    def finish(self) -> None:
        """Flush bytes still waiting for the rest of a character (they decode as U+FFFD)."""
        if self.stopped or self._read == len(self.tokens):
            return
        prefix_text = self._decode(self.tokens[self._prefix:self._read], skip_special_tokens=self._skip)
        full_text = self._decode(self.tokens[self._prefix:], skip_special_tokens=self._skip)
        self._read = len(self.tokens)
        self._append(full_text[len(prefix_text):])

    def pop_delta(self, final: bool = False) -> str:
        """Text not yet emitted that no stop string can still remove."""
        limit = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted:limit]
        self._emitted = limit
        return delta

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - self._hold)
        text = self.text + delta
        if self.stop and len(self.tokens) >= self.min_tokens:
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                text = text[:min(hits)]
                self.stopped = True
        self.text = text  # one assignment: a reader never sees text a stop string removes
