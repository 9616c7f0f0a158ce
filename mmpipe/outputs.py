"""What a finished (or streaming) request returns to the user."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds (monotonic clock), from the call that submitted it
    (`chat`, `generate`, `stream`; for `chat_stream`, from when its conversation was read from
    the iterable): what the caller waits for, host work included."""

    preprocess_s: float = 0.0  # from submission until the engine had it: template, tokens, images
    queued_s: float = 0.0  # from then until its first forward started
    time_to_first_token_s: float = 0.0  # from submission to the first generated token
    total_s: float = 0.0  # from submission to completion
    decode_tokens_per_s: float = 0.0  # generated tokens after the first, per second

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class RequestOutput:
    """The result of one request.

    `finish_reason`: "stop" (a stop token or string), "length" (max_new_tokens), "abort", or
    "error" (then `error` says why and `text` is empty). `logprobs`, when asked for, has one
    {token_id: logprob} dict per generated token: the top-k tokens plus the chosen one.
    `num_cached_tokens`: prompt tokens whose K/V the prefix cache already held.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    num_cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None
