"""`mmpipe serve`'s Pipeline in a process of its own, so that the HTTP work (parsing bodies,
writing every streamed chunk) and the engine's host work (scheduling, launching graphs) run on two
interpreters, not in turns under one interpreter lock: in one process, the server's event loop
waited for the lock while the engine stepped, and the engine waited while the loop wrote chunks.

The two processes share one socket pair. The server's side (`EngineProcess`, on the app's event
loop) sends ("start", id, kind, payload, sampling), ("abort", id), ("call", id, name, args) and
("close",); the engine's side (`engine_main`, `EngineHost`) answers with ("events", [(id, event),
...]), one message per engine step for every choice that step advanced (the stream loop's
after-step hook), and ("result", id, value, error). Messages are pickled, each framed by its length.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import importlib
import itertools
import logging
import multiprocessing
import pickle
import signal
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mmpipe.app.serve_choices import PREPARE_THREADS, ChoiceFeed, Failure, Receiver, stream_maker

from mmpipe.config import SamplingParams
from mmpipe.errors import EngineError

log = logging.getLogger("mmpipe.serve")
HEADER = struct.Struct("!Q")
CALL_TIMEOUT_S = 120.0  # a call (stats) waits at most this long for the engine's answer
CLOSE_TIMEOUT_S = 60.0  # the engine's process gets this long to close its pipeline before it is killed
TERMINAL = ("end", "error")


# ------------------------------------------------------------------ framing


def _frame(message: Any) -> tuple[bytes, bytes]:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)), data


class Link:
    """One end of the socket pair with blocking, thread-safe sends (the engine's side; the
    server's side before its event loop runs)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        header, data = _frame(message)
        with self._send_lock:
            self.sock.sendall(header)
            self.sock.sendall(data)

    def recv(self) -> Any:
        """The next message, or None once the other side has closed."""
        header = self._exactly(HEADER.size)
        if header is None:
            return None
        body = self._exactly(HEADER.unpack(header)[0])
        return None if body is None else pickle.loads(body)

    def _exactly(self, size: int) -> bytearray | None:
        buffer, view, got = bytearray(size), None, 0
        view = memoryview(buffer)
        while got < size:
            try:
                n = self.sock.recv_into(view[got:], size - got)
            except (ConnectionError, OSError):
                return None
            if n == 0:
                return None
            got += n
        return buffer


# ------------------------------------------------------------------ the engine's side


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return EngineError(f"{type(exc).__name__}: {exc}")


def settle_heap() -> None:
    """Collect once, then freeze every object alive (start-up's: modules, weights' wrappers, the
    tokenizer) out of the garbage collector's view. A full collection walks the whole heap, which
    with transformers and torch imported is a pause long enough to show in a streaming request's
    latency wherever the collector decides to run. Frozen objects are never walked again (nor
    freed, which start-up's need not be)."""
    gc.collect()
    gc.freeze()


def engine_main(sock: socket.socket, model: str | None, options: dict[str, Any]) -> None:
    """The engine process: load the Pipeline, say so, then serve the server's messages until it
    closes. Ctrl-C and SIGTERM are the server's to handle: it stops accepting, aborts what runs
    and then closes this process (which also ends when the server's process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    link = Link(sock)
    try:
        from mmpipe import Pipeline

        pipe = Pipeline.from_pretrained(model, **options)
        pipe.prepare_structured_output()  # response_format's first request would otherwise wait for it
    except BaseException as exc:  # noqa: BLE001 (the server's side raises it)
        link.send(("failed", _picklable(exc)))
        return
    with pipe:
        settle_heap()
        link.send(("ready", {"model_path": pipe.model.path, "max_model_len": pipe.runner.max_model_len,
                             "max_running_requests": pipe.engine_config.max_running_requests,
                             "tokenizer": pipe.tokenizer}))
        EngineHost(pipe, link).serve()


class EngineHost:
    """The engine's side: a feed per choice (`ChoiceFeed`, made on a worker thread); their events
    gathered and sent once per engine step."""

    def __init__(self, pipe: Any, link: Link) -> None:
        self.pipe, self.link = pipe, link
        self.feeds: dict[int, ChoiceFeed] = {}
        self._events: list[tuple[int, tuple]] = []
        self._lock = threading.Lock()  # the feeds and the events not yet sent
        self._flush_lock = threading.Lock()  # one batch taken and sent at a time
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="mmpipe-engine")

    def serve(self) -> None:
        while (message := self.link.recv()) is not None:
            op = message[0]
            if op == "start":
                _, cid, kind, payload, sampling = message
                feed = ChoiceFeed(stream_maker(self.pipe, kind, payload, sampling), self._emitter(cid), self.flush)
                with self._lock:
                    self.feeds[cid] = feed
                self._pool.submit(self._prepare, feed)
            elif op == "abort":
                with self._lock:
                    feed = self.feeds.get(message[1])
                if feed is not None:
                    feed.stop()
            elif op == "call":
                self._pool.submit(self._call, *message[1:])
            elif op == "close":
                break
        with self._lock:
            feeds = list(self.feeds.values())
        for feed in feeds:
            feed.stop()
        self._pool.shutdown(wait=True)
        log.info("mmpipe serve: the engine process closes its pipeline")

    def _emitter(self, cid: int) -> Any:
        def emit(event: tuple) -> None:
            with self._lock:
                self._events.append((cid, event))
                if event[0] in TERMINAL:
                    self.feeds.pop(cid, None)
        return emit

    def _prepare(self, feed: ChoiceFeed) -> None:
        feed.run()
        self.flush()  # "ready" (or the failure to start) goes at once

    def flush(self) -> None:
        """Send what the choices emitted since the last flush (the stream loop calls it after each
        step; a preparing thread after a choice starts). Batches leave in the order they were
        taken, so a choice's events arrive in the order it emitted them."""
        with self._flush_lock:
            with self._lock:
                events, self._events = self._events, []
            if events:
                try:
                    self.link.send(("events", events))
                except OSError:  # the server's process is gone: its socket's end ends `serve`
                    pass

    def _call(self, qid: int, name: str, args: tuple) -> None:
        """`stats`, or `module:function` called as function(pipe, *args) (the benchmark's API runs)."""
        try:
            if name == "stats":
                value, error = self.pipe.stats(), None
            else:
                module, function = name.split(":")
                value, error = getattr(importlib.import_module(module), function)(self.pipe, *args), None
        except Exception as exc:  # noqa: BLE001 (raised on the server's side)
            value, error = None, _picklable(exc)
        try:
            self.link.send(("result", qid, value, error))
        except OSError:
            pass


# ------------------------------------------------------------------ the server's side


class EngineProcess:
    """The server's handle on the engine process: starts it (and waits until its Pipeline is
    loaded, or raises why it could not be), then carries choices to it and their events back, on
    the event loop it is attached to (the app's)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        ours, theirs = socket.socketpair()
        # Not a daemon: multiprocessing would terminate it at this interpreter's exit, and it
        # ignores SIGTERM; `close` ends it (and it ends by itself once this process is gone).
        self._process = context.Process(target=engine_main, args=(theirs, model, options), name="mmpipe-engine")
        self._process.start()
        theirs.close()
        self._sock = ours
        self._ids = itertools.count()
        self._receivers: dict[int, Receiver] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self.failure: str | None = None  # why the engine process is gone, once it is
        try:
            reply = Link(ours).recv()
        except BaseException:  # Ctrl-C while the model loads: no orphan left loading it
            self._process.kill()
            raise
        if reply is None:
            self._process.join(10)
            raise EngineError(f"the engine process ended while loading the model (exit code {self._process.exitcode})")
        if reply[0] == "failed":
            self._process.join(10)
            raise reply[1]
        info = reply[1]
        self.model_path, self.tokenizer = info["model_path"], info["tokenizer"]
        self.max_model_len, self.max_running_requests = info["max_model_len"], info["max_running_requests"]

    def wait(self, timeout: float | None = None) -> None:
        """Until the engine process has ended (or `timeout` seconds)."""
        self._process.join(timeout)

    @property
    def alive(self) -> bool:
        return self.failure is None and self._process.is_alive()

    async def attach(self) -> None:
        """Read and write on the running event loop (the app's start-up); one app at a time."""
        if self._loop is not None:
            raise EngineError("the engine process serves one app at a time, and one is attached")
        self._loop = asyncio.get_running_loop()
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock.dup())
        self._reading = asyncio.create_task(self._read(reader))

    async def aclose(self) -> None:
        """The app's shutdown: stop reading (the process stays until `close`)."""
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
        self._loop = self._writer = self._reading = None

    def close(self) -> None:
        """Have the engine process abort what runs, close its Pipeline and exit (killed if it does not)."""
        if self._process.is_alive():
            self._sock.setblocking(True)  # the event loop's copy of the socket had made it non-blocking
            try:
                Link(self._sock).send(("close",))
            except OSError:
                pass
            self._process.join(CLOSE_TIMEOUT_S)
            if self._process.is_alive():
                log.error("mmpipe serve: the engine process did not close in %.0f s; killed", CLOSE_TIMEOUT_S)
                self._process.kill()
                self._process.join(10)
        self._sock.close()

    # -------------------------------------------------------------- choices (on the event loop)

    def start(self, receiver: Receiver, kind: str, payload: Any, sampling: SamplingParams) -> int:
        cid = next(self._ids)
        if not self.alive:
            receiver.receive(("error", Failure("internal", self.failure or "the engine process has ended")))
            return cid
        self._receivers[cid] = receiver
        self._send(("start", cid, kind, payload, sampling))
        return cid

    def abort(self, handle: int) -> None:
        """From any thread."""
        self._send(("abort", handle))

    def stats(self) -> dict[str, Any]:
        """`Pipeline.stats()` of the engine's process (blocks: call it off the event loop)."""
        return self.call("stats")

    def call(self, name: str, *args: Any) -> Any:
        """`module:function`(pipe, *args) in the engine's process; its result. From any thread but
        the event loop's; with no app attached, on an event loop of its own for the call."""
        loop = self._loop
        if loop is None:
            async def detached() -> Any:
                await self.attach()
                try:
                    return await asyncio.wait_for(asyncio.wrap_future(self._ask(name, args)), CALL_TIMEOUT_S)
                finally:
                    await self.aclose()

            return asyncio.run(detached())
        future: concurrent.futures.Future = concurrent.futures.Future()
        loop.call_soon_threadsafe(lambda: future.set_result(self._ask(name, args)))
        return future.result(CALL_TIMEOUT_S).result(CALL_TIMEOUT_S)

    def _ask(self, name: str, args: tuple) -> concurrent.futures.Future:
        """Send a call (on the event loop); the future its result will resolve."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        qid = next(self._ids)
        if not self.alive:
            future.set_exception(EngineError(self.failure or "the engine process has ended"))
            return future
        self._calls[qid] = future
        self._send(("call", qid, name, args))
        return future

    def _send(self, message: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            loop.call_soon_threadsafe(self._send, message)
            return
        if self._writer is not None and not self._writer.is_closing():
            self._writer.writelines(_frame(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                size = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
                message = pickle.loads(await reader.readexactly(size))
                if message[0] == "events":
                    for cid, event in message[1]:
                        receiver = self._receivers.get(cid)
                        if receiver is None:
                            continue
                        if event[0] in TERMINAL:
                            del self._receivers[cid]
                        receiver.receive(event)
                elif message[0] == "result":
                    future = self._calls.pop(message[1], None)
                    if future is not None:
                        if message[3] is not None:
                            future.set_exception(message[3])
                        else:
                            future.set_result(message[2])
        except (asyncio.IncompleteReadError, ConnectionError):
            self._ended()

    def _ended(self) -> None:
        """The engine process is gone: every choice still running fails, every call too."""
        self._process.join(1)
        self.failure = f"the engine process ended (exit code {self._process.exitcode})"
        log.error("mmpipe serve: %s", self.failure)
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            receiver.receive(("error", Failure("internal", self.failure)))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(EngineError(self.failure))
