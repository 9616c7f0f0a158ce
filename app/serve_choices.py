"""Where a server's choices run: beside the Pipeline. `ChoiceFeed` turns one choice's `TextStream`
into events; `LocalEngine` runs feeds in the server's own process (`create_app(pipe)`, for an app
that embeds the server); the engine process (app/serve_engine.py) runs them in a process of its
own (`mmpipe serve`). Either way the server's side (app/serve_api.py) sees the same events, on its
event loop, through `Choice.receive`.

Events are plain tuples, so they cross a process boundary as they are:
  ("ready",)                                  the choice's stream is made (its request starts next)
  ("delta", text, token_ids, logprobs, first) new text; `first` = (ttft_s, prompt_tokens) with
                                              the choice's first tokens, else None
  ("end", RequestOutput, seen)                the end (after `seen` tokens were handed on)
  ("error", Failure)                          the choice could not start, or its step failed
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from mmpipe.config import SamplingParams
from mmpipe.errors import InputError, MmpipeError
from mmpipe.text_stream import TextStream

log = logging.getLogger("mmpipe.serve")
PREPARE_THREADS = 64  # choices whose chat is rendered and media decoded at once


@dataclass(frozen=True)
class Failure:
    """Why a choice failed, picklable whatever the exception was. `kind`: "input" (the request's
    fault: 400), "mmpipe" (an error mmpipe names: 400), "internal" (500)."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        if isinstance(exc, InputError):
            return cls("input", str(exc))
        if isinstance(exc, MmpipeError):
            return cls("mmpipe", str(exc))
        return cls("internal", f"{type(exc).__name__}: {exc}")


def stream_maker(pipe: Any, kind: str, payload: Any, sampling: SamplingParams) -> Callable[[], TextStream]:
    """What a choice runs: `kind` "chat" (payload: the conversation) or "prompt" (the text)."""
    if kind == "chat":
        return lambda: pipe.stream(payload, sampling)
    return lambda: pipe.stream_prompt(payload, (), sampling)


class ChoiceFeed:
    """One choice beside the Pipeline: `run` (on a worker thread) makes its stream (renders the
    chat, decodes the media) and subscribes to it; the stream loop then calls `_on_text` after
    every step that brings text. Every event goes to `emit`; the last is always an "end" or an
    "error", even for a stopped choice, so the server's side always learns that it ended."""

    def __init__(self, make_stream: Callable[[], TextStream], emit: Callable[[tuple], None],
                 after_step: Callable[[], None] | None = None) -> None:
        self.make_stream, self.emit, self.after_step = make_stream, emit, after_step
        self.cancel = threading.Event()
        self.stream: TextStream | None = None
        self.seen = 0  # tokens handed on

    def stop(self) -> None:
        """Cancel from any thread without waiting: the request is aborted before the engine's next step."""
        self.cancel.set()
        if self.stream is not None:
            self.stream.abort()

    def run(self) -> None:
        try:
            stream = self.make_stream()
        except Exception as exc:  # noqa: BLE001 (handed to the server's side)
            self.emit(("error", Failure.of(exc)))
            return
        self.stream = stream
        if self.cancel.is_set():  # stopped while the stream was being made
            stream.abort()
        # "ready" before the request starts: its end may come from the stream loop before this
        # thread runs again, and no event may follow a choice's end.
        self.emit(("ready",))
        try:
            stream.subscribe(self._on_text, self.after_step)
        except Exception as exc:  # noqa: BLE001 (the pipeline is closing)
            self.emit(("error", Failure.of(exc)))

    def _on_text(self, delta: Any, done: bool) -> None:
        """The stream loop's call (its thread): new text, the end, or a failed step (`delta` is
        then the exception)."""
        stream = self.stream
        assert stream is not None
        if isinstance(delta, BaseException):
            log.error("a request failed while generating: %s", delta)
            self.emit(("error", Failure.of(delta)))
            return
        if delta and not self.cancel.is_set():
            ids, lps = stream.tokens_since(self.seen)  # the tokens behind this text, as the engine has them now
            first = None
            if ids and not self.seen:
                first = (stream.metrics().time_to_first_token_s, stream.num_prompt_tokens)
            self.seen += len(ids)
            self.emit(("delta", delta, ids, lps, first))
        if done:
            self.emit(("end", stream.output(), self.seen))


class Receiver(Protocol):
    """The server's side of a choice (`serve_api.Choice`)."""

    def receive(self, event: tuple) -> None: ...  # on the event loop


class Outbox:
    """Events from other threads for the event loop, handed over in batches: one wake-up of the
    loop (`call_soon_threadsafe`, a write to its pipe) for all that arrives before it runs, not
    one per token of every choice."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[Receiver, tuple]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, receiver: Receiver, event: tuple) -> None:
        with self._lock:
            self._items.append((receiver, event))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop has closed (shutdown): nobody is listening
            pass

    def _hand_over(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for receiver, event in items:
            receiver.receive(event)


class LocalEngine:
    """The Pipeline in the server's own process. Its engine's host work and the server's HTTP work
    then share one interpreter lock (the engine process avoids that)."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.tokenizer = pipe.tokenizer
        self.model_path = pipe.model.path
        self.max_model_len = pipe.runner.max_model_len
        self.max_running_requests = pipe.engine_config.max_running_requests
        self._outbox: Outbox | None = None
        self._pool: ThreadPoolExecutor | None = None
        pipe.prepare_structured_output()  # response_format's first request would otherwise wait for it

    async def attach(self) -> None:
        """Serve the app on the running event loop (its start-up): events are handed to this loop."""
        self._outbox = Outbox(asyncio.get_running_loop())
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="mmpipe-serve")

    def start(self, receiver: Receiver, kind: str, payload: Any, sampling: SamplingParams) -> ChoiceFeed:
        """Start a choice; its events reach `receiver.receive` on the event loop. Returns its handle."""
        outbox, pool = self._outbox, self._pool
        assert outbox is not None and pool is not None, "attach() first (the app's start-up does)"
        feed = ChoiceFeed(stream_maker(self.pipe, kind, payload, sampling), lambda e: outbox.put(receiver, e))
        pool.submit(feed.run)
        return feed

    def abort(self, handle: ChoiceFeed) -> None:
        handle.stop()

    def stats(self) -> dict[str, Any]:
        """`Pipeline.stats()` (blocks for the step in flight: call it off the event loop)."""
        return self.pipe.stats()

    async def aclose(self) -> None:
        """The app's shutdown (its choices stopped): let the preparing threads end. The Pipeline
        stays its owner's, and another app may attach after."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)
