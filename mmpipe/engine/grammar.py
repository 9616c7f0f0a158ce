"""Structured output: JSON Schemas compiled to grammars, one matcher per constrained request, and
the bitmasks of the tokens each may take next, which the sampler applies.

The grammar engine is llguidance (the other one vLLM offers beside xgrammar). It computes a mask
on demand from a lazily built lexer and parser, with no per-schema compilation step to wait for
(a new schema costs its first mask, not a compile), covers JSON Schema widely, and ships one
self-contained wheel for every Python version that pins no torch release. Its executor fills the
masks of a batch on its own threads with the GIL released, so the engine computes them while the
GPU runs the step's forward (`Engine.step`).

A mask row is int32 words, bit t of word t // 32 set when token t is allowed (llguidance's
layout); the width covers the model's vocabulary (its logits' width), so padded ids past the
tokenizer's are never allowed. End of sequence (the checkpoint's end-of-sequence ids) is allowed
once the JSON is complete.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Sequence

import numpy as np

from mmpipe.errors import InputError
from mmpipe.json_grammar import JSON_LAYOUT, summary

log = logging.getLogger("mmpipe")
SCHEMAS_KEPT = 256  # compiled grammars kept, by schema text


def mask_width(vocab: int) -> int:
    """int32 words per mask row."""
    return (vocab + 31) // 32


class Grammars:
    """One pipeline's grammar engine: the tokenizer as llguidance sees it (built on first use),
    schemas checked and kept, matchers made, masks filled."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> None:
        self._hf, self.vocab, self._eos = tokenizer, vocab, list(eos_ids)
        self.width = mask_width(vocab)
        self._tokenizer: Any = None
        self._built = threading.Event()  # set once a background build (if any) has ended
        self._built.set()
        self._grammars: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()  # requests are prepared on several threads

    def build_in_background(self, checkpoint: str) -> None:
        """Build llguidance's view of the tokenizer now, on a thread of its own, from a tokenizer of
        its own (the shared one may only be used under the pipeline's text lock). Else the first
        request with a schema builds it while preparing, which for a vocabulary of Qwen's size
        takes seconds and holds up every other request's preparation."""
        if self._tokenizer is not None or not self._built.is_set():
            return
        self._built.clear()

        def build() -> None:
            try:
                import llguidance.hf

                from mmpipe.tokenizer import load_tokenizer
                built = llguidance.hf.from_tokenizer(load_tokenizer(checkpoint), n_vocab=self.vocab,
                                                     eos_token=self._eos)
                self._tokenizer = self._tokenizer or built
            except Exception:  # noqa: BLE001 (the first request builds it then, and says what fails)
                log.debug("building the grammar engine's tokenizer in the background failed", exc_info=True)
            finally:
                self._built.set()

        threading.Thread(target=build, name="mmpipe-grammar-tokenizer", daemon=True).start()

    def _library(self) -> Any:
        try:
            import llguidance
            import llguidance.hf
        except ImportError as exc:  # a core dependency; only a broken install lacks it
            raise InputError(f"json_schema needs the llguidance package ({exc}); pip install llguidance") from None
        self._built.wait()  # a background build under way
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab, eos_token=self._eos)
        return llguidance

    def grammar(self, schema: str, where: str) -> str:
        """The grammar of a JSON Schema (canonical JSON text), checked against the tokenizer;
        InputError naming `where` and what the grammar engine found wrong."""
        with self._lock:
            grammar = self._grammars.get(schema)
            if grammar is not None:
                self._grammars.move_to_end(schema)
                return grammar
            library = self._library()
            try:
                grammar = library.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
                error = library.LLMatcher.validate_grammar(grammar, self._tokenizer)
            except (ValueError, TypeError, RuntimeError) as exc:
                error = str(exc)
            if error:
                raise InputError(f"{where}: json_schema cannot be compiled: {summary(error)}")
            self._grammars[schema] = grammar
            if len(self._grammars) > SCHEMAS_KEPT:
                self._grammars.popitem(last=False)
            return grammar

    def matcher(self, schema: str, where: str) -> "Matcher":
        """A fresh matcher of the schema, at the start of the output."""
        grammar = self.grammar(schema, where)
        library = self._library()
        return Matcher(library.LLMatcher(self._tokenizer, grammar, log_level=0))



_executor: Any = None  # llguidance's thread pool, one per process


def fill_masks(rows: Sequence[tuple["Matcher", int]], masks: np.ndarray) -> None:
    """Write each matcher's mask of allowed next tokens into row `index` of `masks` (int32,
    C-contiguous [rows, width]), in parallel on llguidance's threads with the GIL released; other
    rows are left as they are."""
    global _executor
    if not rows:
        return
    if masks.dtype != np.int32 or not masks.flags.c_contiguous or masks.ndim != 2:
        raise ValueError("masks must be a C-contiguous int32 [rows, words] array")
    if max(index for _, index in rows) >= masks.shape[0] or min(index for _, index in rows) < 0:
        raise ValueError("a mask row index is outside the masks array")
    if _executor is None:
        import llguidance
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m.inner, index) for m, index in rows], masks.ctypes.data,
                                      masks.shape[1] * 4, masks.shape[0])


def masks_of(matchers: Sequence["Matcher | None"], vocab: int) -> np.ndarray:
    """[len(matchers), words] masks: each matcher's, every token for None."""
    masks = np.full((len(matchers), mask_width(vocab)), -1, dtype=np.int32)
    fill_masks([(m, i) for i, m in enumerate(matchers) if m is not None], masks)
    return masks


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def accept(self, token: int) -> str | None:
        """Advance by a generated token; the reason if the grammar rejects it (None: accepted)."""
        if self.inner.consume_token(token):
            return None
        return _first_line(self.inner.get_error() or f"token {token} is not allowed here")

    @property
    def complete(self) -> bool:
        """The output is a complete value the grammar accepts and nothing more may follow."""
        return bool(self.inner.is_stopped())


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
