"""`Pipeline.stream`'s result: one request's text deltas as they are generated, and its counts and
timings at any moment."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any

from mmpipe.engine.engine import Engine
from mmpipe.engine.request import Request
from mmpipe.outputs import RequestMetrics, RequestOutput
from mmpipe.stream_loop import StreamLoop


class TextStream(Iterator[str]):
    """One streamed request: iterate for text deltas; read its counts and timings at any time.

    The request joins the engine on the first `next()` (or `subscribe`); the Pipeline's stream
    loop (`mmpipe.stream_loop`) steps the engine for every stream and hands each its new text after
    every step, so streams read from any number of threads are batched together and each gets
    its text a step at a time. `close()` (or leaving a `with` block, or garbage collection of an
    unfinished stream) aborts the request; `abort()` asks for that from any thread.
    """

    def __init__(self, engine: Engine, request: Request, loop: StreamLoop) -> None:
        self._engine = engine
        self.request = request
        self.aborting = False
        self._loop = loop
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._listener: Callable[[str, bool], None] | None = None
        self.after_step: Callable[[], None] | None = None  # the loop calls it once a step, after its deliveries
        self._started = self._ended = False

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        if self._listener is not None:
            raise RuntimeError("this stream was subscribed to: its text goes to the listener")
        self._start()
        while not self._ended:
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._ended = True
                raise item
            delta, done = item
            self._ended = done
            if delta:
                return delta
        raise StopIteration

    def subscribe(self, listener: Callable[[str, bool], None], after_step: Callable[[], None] | None = None) -> None:
        """Start the request; `listener(delta, done)` is called on the stream loop's thread after
        each step that brings text, and once with done=True at the end (then the request has
        finished: `output()` is final). A step that fails calls it with the exception as delta
        (done=True). For a caller that must not block a thread per stream (an event loop).
        `after_step()` is called once after all of a step's listener calls, however many
        subscribed streams share it: a place to send a step's worth of events at once."""
        if self._started:
            raise RuntimeError("this stream has started already")
        self._listener = listener
        self.after_step = after_step
        self._start()

    def close(self) -> None:
        """Abort the request if it is still running (and stop reading it)."""
        if self._started and not self._ended:
            self.abort()
            if self._listener is None:
                while not self._ended:  # wait for the loop to have aborted it: its pages are back
                    item = self._queue.get()
                    self._ended = isinstance(item, BaseException) or item[1]
        self._ended = True

    def abort(self) -> None:
        """Abort the request from any thread, without waiting for the engine: the stream loop
        aborts it before its next step (frees its KV pages) and the stream ends, even while its
        tokens make no text (special tokens, text held back for a stop string)."""
        self.aborting = True
        if self._started:
            self._loop.wake()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The stream loop's side.

    def deliver(self, delta: str, done: bool) -> None:
        if self._listener is not None:
            self._listener(delta, done)
        else:
            self._queue.put((delta, done))

    def fail(self, error: BaseException) -> None:
        if self._listener is not None:
            self._listener(error, True)  # type: ignore[arg-type]
        else:
            self._queue.put(error)

    def _start(self) -> None:
        if not self._started:
            self._loop.add(self, keep=self._listener is not None)  # raises (the pipeline closed): not started
            self._started = True

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.prompt_len

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache already held (known once the request is admitted)."""
        return self.request.num_cached_tokens

    @property
    def num_image_tokens(self) -> int:
        return sum(image.num_tokens for image in self.request.images)

    @property
    def num_images(self) -> int:
        return len(self.request.images)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.request.output_ids)

    @property
    def finish_reason(self) -> str | None:
        """None while running; then "stop", "length" or "abort" (`RequestOutput`)."""
        return self.request.finish_reason

    def tokens_since(self, start: int) -> tuple[list[int], list[dict[int, float]]]:
        """The token ids generated from index `start` on, as the engine has them now, and their
        logprobs (empty unless the request asked for them)."""
        with self._engine.lock:
            ids = list(self.request.output_ids[start:])
            return ids, list(self.request.logprobs[start:start + len(ids)])

    def output(self) -> RequestOutput:
        """The request's `RequestOutput` so far (final once the stream is exhausted)."""
        with self._engine.lock:
            return self.request.to_output()

    def metrics(self) -> RequestMetrics:
        """Timings so far (time to first token, decode tokens/s, ...), final once finished."""
        with self._engine.lock:
            return self.request.metrics()
