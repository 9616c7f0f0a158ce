"""The thread that steps a Pipeline's engine for its streams (`Pipeline.stream`, the server, the demo).

One thread per Pipeline, started with the first stream and idle while none runs: it steps the
engine under the engine's lock and, after every step, hands each stream the text (and tokens) its
request gained, so every stream advances by a token a step whatever the number of streams and
threads reading them. (Streams that each stepped the engine from their reader's thread queued on
its lock, and a reader got its text only when it won the lock: under load, chunks of many tokens
and a time to first token that grew with the number of readers.)

Batch calls (`chat`, `generate`, `caption`) still step the engine in their caller's thread; the
lock keeps one step at a time, and whatever runs a step advances every request in the engine.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Protocol

from mmpipe.engine.engine import Engine
from mmpipe.engine.request import Request

log = logging.getLogger("mmpipe")


class Stream(Protocol):
    """What the loop needs of a stream (`TextStream` has it)."""

    request: Request
    aborting: bool

    def deliver(self, delta: str, done: bool) -> None: ...  # called on the loop's thread

    def fail(self, error: BaseException) -> None: ...


class StreamLoop:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # Weak references: a stream its reader dropped unfinished is aborted, not run to its end.
        self._streams: list[tuple[weakref.ref[Stream], Request]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, stream: Stream) -> None:
        """Put the stream's request in the engine and step it until it finishes or is aborted."""
        with self._engine.lock:
            self._engine.add(stream.request)
        with self._wake:
            if self._closed:
                raise RuntimeError("the pipeline is closed")
            self._streams.append((weakref.ref(stream), stream.request))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mmpipe-streams", daemon=True)
                self._thread.start()
            self._wake.notify()

    def wake(self) -> None:
        """A stream asked to abort: let the loop see it now, even if it is idle."""
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        """Stop the thread (after its step in flight); streams still running end as aborted."""
        with self._wake:
            self._closed = True
            streams, self._streams = self._streams, []
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        for ref, _ in streams:
            stream = ref()
            if stream is not None:
                stream.deliver("", True)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._streams and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                streams = list(self._streams)
            try:
                ended = self._step(streams)
            except BaseException as exc:  # noqa: BLE001 (each stream's reader gets it)
                log.debug("a step for the streams failed", exc_info=True)
                ended = {id(request) for _, request in streams}
                with self._engine.lock:
                    for _, request in streams:
                        if not request.finished:
                            self._engine.abort(request)
                for ref, _ in streams:
                    stream = ref()
                    if stream is not None:
                        stream.fail(exc)
            if ended:
                with self._wake:
                    self._streams = [e for e in self._streams if id(e[1]) not in ended]

    def _step(self, streams: list[tuple[weakref.ref[Stream], Request]]) -> set[int]:
        """Abort what was asked (or dropped), step the engine once, deliver every stream's new
        text; returns the ids of the requests that ended."""
        engine, ended = self._engine, set()
        with engine.lock:
            live = []
            for ref, request in streams:
                stream = ref()
                if (stream is None or stream.aborting) and not request.finished:
                    engine.abort(request)
                if stream is None:
                    ended.add(id(request))
                else:
                    live.append((stream, request))
            if any(not request.finished for _, request in live):
                engine.step()
            deliveries: list[tuple[Stream, str, bool]] = []
            for stream, request in live:
                if request.finished:
                    request.detokenizer.finish()
                    deliveries.append((stream, request.detokenizer.pop_delta(final=True), True))
                    ended.add(id(request))
                else:
                    delta = request.detokenizer.pop_delta()
                    if delta:
                        deliveries.append((stream, delta, False))
        for stream, delta, done in deliveries:  # outside the lock: a reader may take it at once
            stream.deliver(delta, done)
        return ended

