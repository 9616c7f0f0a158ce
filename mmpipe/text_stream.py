"""`Pipeline.stream`'s result: one request's text deltas as they are generated, and its counts and
timings at any moment."""

from __future__ import annotations

from typing import Any, Iterator

from mmpipe.engine.engine import Engine
from mmpipe.engine.request import Request
from mmpipe.outputs import RequestMetrics, RequestOutput


class TextStream(Iterator[str]):
    """One streamed request: iterate for text deltas; read its counts and timings at any time.

    The request joins the engine on the first `next()`. Whichever thread iterates steps the
    shared engine, so streams from several threads are batched together. `close()` (or leaving a
    `with` block, or garbage collection of an unfinished stream) aborts the request.
    """

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine = engine
        self._request = request
        self._deltas = self._run()

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def num_prompt_tokens(self) -> int:
        return self._request.prompt_len

    @property
    def num_image_tokens(self) -> int:
        return sum(image.num_tokens for image in self._request.images)

    @property
    def num_images(self) -> int:
        return len(self._request.images)

    @property
    def num_generated_tokens(self) -> int:
        return len(self._request.output_ids)

    @property
    def finish_reason(self) -> str | None:
        """None while running; then "stop", "length" or "abort" (`RequestOutput`)."""
        return self._request.finish_reason

    def tokens_since(self, start: int) -> tuple[list[int], list[dict[int, float]]]:
        """The token ids generated from index `start` on, as the engine has them now, and their
        logprobs (empty unless the request asked for them)."""
        with self._engine.lock:
            ids = list(self._request.output_ids[start:])
            return ids, list(self._request.logprobs[start:start + len(ids)])

    def output(self) -> RequestOutput:
        """The request's `RequestOutput` so far (final once the stream is exhausted)."""
        with self._engine.lock:
            return self._request.to_output()

    def metrics(self) -> RequestMetrics:
        """Timings so far (time to first token, decode tokens/s, ...), final once finished."""
        with self._engine.lock:
            return self._request.metrics()

    def _run(self) -> Iterator[str]:
        engine, request = self._engine, self._request
        with engine.lock:
            engine.add(request)
        try:
            while True:
                if request.finished:
                    with engine.lock:
                        request.detokenizer.finish()
                        tail = request.detokenizer.pop_delta(final=True)
                    if tail:
                        yield tail
                    return
                with engine.lock:  # another thread's step may be extending this text right now
                    delta = request.detokenizer.pop_delta()
                if delta:
                    yield delta
                with engine.lock:
                    if not request.finished:
                        engine.step()
        finally:
            if not request.finished:
                with engine.lock:
                    engine.abort(request)
