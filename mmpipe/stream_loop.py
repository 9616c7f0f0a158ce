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
from collections.abc import Callable
from typing import Any, Protocol

from mmpipe.engine.engine import Engine
from mmpipe.engine.request import Request

log = logging.getLogger("mmpipe")


class Stream(Protocol):
    """What the loop needs of a stream (`TextStream` has it)."""

    request: Request
    aborting: bool
    after_step: Callable[[], None] | None  # called once a step after the deliveries (shared hooks once)

    def deliver(self, delta: str, done: bool) -> None: ...  # called on the loop's thread

    def fail(self, error: BaseException) -> None: ...


class StreamLoop:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # Weak references: a stream its reader dropped unfinished is aborted, not run to its end
        # (a subscribed stream is held by its entry: its listener is owed an end).
        self._streams: list[_Entry] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, stream: Stream, keep: bool = False) -> None:
        """Put the stream's request in the engine and step it until it finishes or is aborted.
        `keep`: hold the stream itself, not a weak reference (a subscribed stream)."""
        with self._wake:
            if self._closed:
                raise RuntimeError("the pipeline is closed")
            with self._engine.lock:
                self._engine.add(stream.request)
            self._streams.append(_Entry(stream, keep))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mmpipe-streams", daemon=True)
                self._thread.start()
            self._wake.notify()

    def wake(self) -> None:
        """A stream asked to abort: let the loop see it now, even if it is idle."""
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        """Stop the thread (after its step in flight); streams still running are aborted and end."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._wake:
            entries, self._streams = self._streams, []
        with self._engine.lock:
            for entry in entries:
                if not entry.request.finished:
                    self._engine.abort(entry.request)
        for entry in entries:
            _deliver(entry, "", True)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._streams and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                entries = list(self._streams)
            try:
                deliveries = self._step(entries)
            except BaseException as exc:
                log.debug("a step for the streams failed", exc_info=True)
                with self._engine.lock:
                    for entry in entries:
                        if not entry.request.finished:
                            self._engine.abort(entry.request)
                deliveries = [(entry, exc, True) for entry in entries]
            _hand_out(deliveries)  # outside the lock: a reader may take it at once
            del deliveries  # no reference may keep a dropped stream alive while the loop waits
            ended = {id(entry) for entry in entries if entry.done}
            if ended:
                with self._wake:
                    self._streams = [e for e in self._streams if id(e) not in ended]

    def _step(self, entries: list[_Entry]) -> list[tuple[_Entry, Any, bool]]:
        """Abort what was asked (or dropped), step the engine once; returns what each stream is
        to be handed (its new text, and whether it ended)."""
        engine = self._engine
        with engine.lock:
            live = []
            for entry in entries:
                stream, request = entry.stream(), entry.request
                if (stream is None or stream.aborting) and not request.finished:
                    engine.abort(request)
                if stream is None:
                    entry.done = True
                else:
                    live.append(entry)
            if any(not entry.request.finished for entry in live):
                engine.step()
            deliveries: list[tuple[_Entry, Any, bool]] = []
            for entry in live:
                request = entry.request
                if request.finished:
                    request.detokenizer.finish()
                    deliveries.append((entry, request.detokenizer.pop_delta(final=True), True))
                else:
                    delta = request.detokenizer.pop_delta()
                    if delta:
                        deliveries.append((entry, delta, False))
        return deliveries


def _hand_out(deliveries: list[tuple[_Entry, Any, bool]]) -> None:
    """Deliver a step's text, then run the after-step hooks of the streams delivered to, each
    once (equal hooks, as one object's bound method, count once)."""
    hooks: dict[Callable[[], None], None] = {}
    for entry, delta, done in deliveries:
        if (hook := _deliver(entry, delta, done)) is not None:
            hooks[hook] = None
    for hook in hooks:
        try:
            hook()
        except Exception:
            log.exception("a stream's after-step hook failed")


class _Entry:
    """A stream the loop steps: its request, how it is held, and whether its end was handed on."""

    def __init__(self, stream: Stream, keep: bool) -> None:
        self.request = stream.request
        self._held = stream if keep else None
        self._ref = weakref.ref(stream)
        self.done = False

    def stream(self) -> Stream | None:
        return self._held if self._held is not None else self._ref()


def _deliver(entry: _Entry, delta: Any, done: bool) -> Callable[[], None] | None:
    """Hand a stream its text, its end, or (`delta` an exception) the failure of its step; once
    ended, nothing more. A reader's callback that raises ends that stream only (its request
    aborted by the next step), never the loop. Returns the stream's after-step hook."""
    if entry.done:
        return None
    entry.done = done
    stream = entry.stream()
    if stream is None:
        return None
    hook = stream.after_step
    try:
        if isinstance(delta, BaseException):
            stream.fail(delta)
        else:
            stream.deliver(delta, done)
    except Exception:
        log.exception("a stream's reader failed on its text; the stream ends")
        stream.aborting = True
    return hook
