"""A request's state from admission to completion, and the rules that end it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from mmpipe.config import ResolvedSampling
from mmpipe.engine.batch import ImageInput
from mmpipe.engine.detokenizer import IncrementalDetokenizer
from mmpipe.outputs import RequestMetrics, RequestOutput


@dataclass(eq=False)  # identity semantics: queues hold and remove requests by identity
class Request:
    index: int  # position in the caller's input list
    prompt_ids: list[int]
    positions: np.ndarray  # [3, prompt_len] M-RoPE positions of the prompt
    mrope_delta: int  # generated token i sits at position i + delta
    images: list[ImageInput]
    image_starts: list[int]  # prompt index of each image's first token
    sampling: ResolvedSampling
    seed: int
    detokenizer: IncrementalDetokenizer
    incremental_text: bool  # detokenise every step (stop strings, streaming) or once at the end
    where: str = ""  # how errors name it ("conversation 3")

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    image_embeds: list[torch.Tensor | None] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    # Prefix cache: keys of its full pages (`prefix_keys`), how many leading pages are cached
    # (found at admission or registered since), and the prompt tokens its first admission found
    # cached.
    cache_keys: list[bytes] = field(default_factory=list)
    pages_cached: int = 0
    num_cached_tokens: int = 0
    # Tokens sampled by launched steps and not yet on the host (overlapped scheduling: at most
    # one at planning time), and whether the newest came from a decode step, whose row then
    # feeds it on the device (a token sampled after a prefill must reach the host first).
    pending: int = 0
    pending_decode: bool = False
    finish_reason: str | None = None
    error: str | None = None
    preemptions: int = 0
    on_finish: Callable[["Request"], None] | None = None  # set by whoever waits for the result
    input_bytes: int = 0  # its images' and videos' resized pixels, counted against input_bytes_ahead
    grammar: Any = None  # a `grammar.Matcher` when the output must follow a JSON schema

    submitted: float | None = None  # the caller's call (None: the engine's arrival)
    arrival: float = field(default_factory=time.monotonic)  # the engine received it
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        if not self.image_embeds:
            self.image_embeds = [None] * len(self.images)
        self._prompt_len = len(self.prompt_ids)  # the prompt never changes; read every step

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def total_len(self) -> int:
        return self._prompt_len + len(self.output_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence, counting those still in flight."""
        return self._prompt_len + len(self.output_ids) + self.pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        p = self._prompt_len
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    def positions_of(self, start: int, end: int) -> np.ndarray:
        """M-RoPE positions [3, end-start] of tokens [start, end) (prompt or generated)."""
        prompt_end = min(end, self.prompt_len)
        parts = []
        if start < prompt_end:
            parts.append(self.positions[:, start:prompt_end])
        if end > self.prompt_len:
            gen = np.arange(max(start, self.prompt_len), end, dtype=np.int64) + self.mrope_delta
            parts.append(np.broadcast_to(gen, (3, gen.shape[0])))
        return np.concatenate(parts, axis=1) if len(parts) > 1 else np.ascontiguousarray(parts[0])

    def mark_scheduled(self) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = time.monotonic()

    def append_token(self, token: int, logprobs: dict[int, float] | None) -> None:
        """Record a generated token and decide whether the request is done."""
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.output_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        sampling = self.sampling
        if self.incremental_text:
            self.detokenizer.add(token)
        if self.grammar is not None:
            rejected = self.grammar.accept(token)
            if rejected is not None:  # the mask allows only what the grammar takes: a bug if reached
                self.finish("error", f"{self.where or 'request'}: the JSON schema's grammar rejected token "
                                     f"{token}: {rejected}")
                return
            if self.grammar.complete:  # the JSON is whole and nothing may follow (end of sequence included)
                self.finish("stop")
                return
        if len(self.output_ids) >= sampling.min_new_tokens and (
                token in sampling.eos_token_ids or token in sampling.stop_token_ids):
            self.finish("stop")
        elif self.detokenizer.stopped:
            self.finish("stop")
        elif len(self.output_ids) >= sampling.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
            self.finished_at = time.monotonic()
            if self.on_finish is not None:
                self.on_finish(self)

    def final_text(self) -> str:
        if not self.incremental_text:  # no stop strings, no streaming: decode once
            self.detokenizer.decode_all(self.output_ids)
            self.incremental_text = True
        self.detokenizer.finish()
        return self.detokenizer.text

    def metrics(self) -> RequestMetrics:
        """Timings as of now (final once the request has finished)."""
        end = self.finished_at or time.monotonic()
        start = self.arrival if self.submitted is None else min(self.submitted, self.arrival)
        metrics = RequestMetrics(preprocess_s=self.arrival - start)
        if self.first_scheduled is not None:
            metrics.queued_s = self.first_scheduled - self.arrival
        if self.first_token is not None:
            metrics.time_to_first_token_s = self.first_token - start
            if len(self.output_ids) > 1 and end > self.first_token:
                metrics.decode_tokens_per_s = (len(self.output_ids) - 1) / (end - self.first_token)
        metrics.total_s = end - start
        return metrics

    def to_output(self) -> RequestOutput:
        metrics = self.metrics()
        text = "" if self.error else self.final_text()
        return RequestOutput(index=self.index, text=text, token_ids=list(self.output_ids),
                             finish_reason=self.finish_reason, num_prompt_tokens=self.prompt_len,
                             num_cached_tokens=self.num_cached_tokens,
                             logprobs=list(self.logprobs) if self.sampling.logprobs else None,
                             metrics=metrics, error=self.error)


def failed_output(index: int, error: str) -> RequestOutput:
    """The output of a request that could not even be built (bad image, bad message)."""
    return RequestOutput(index=index, text="", token_ids=[], finish_reason="error", num_prompt_tokens=0,
                         error=error)


def logprob_dict(chosen: int, chosen_lp: float, ids: list[int], lps: list[float], k: int) -> dict[int, float]:
    out = {int(t): float(v) for t, v in zip(ids[:k], lps[:k])}
    out.setdefault(int(chosen), float(chosen_lp))
    return out

