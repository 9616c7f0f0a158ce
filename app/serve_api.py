"""`mmpipe serve`'s FastAPI app: OpenAI's chat and text completions, models and health, in front of one
`Pipeline`.

Every choice is a `TextStream`: a worker thread renders the chat, decodes the images and subscribes
to the stream; the Pipeline's stream loop steps the shared engine for every stream (so all requests
are batched together) and, after each step, hands each choice's new text straight to the event
loop (through an `Outbox`: one wake-up for a step's worth of text), which never waits on the engine
or on media decoding.
A client that disconnects stops its choices: their streams are aborted before the engine's next
step (even while their tokens make no text), which frees their KV pages. Each choice also
feeds its metrics (app/serve_metrics.py: its first token, its tokens, its end); GET /metrics reads
them and the engine's statistics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from mmpipe.app.serve_metrics import CONTENT_TYPE, ChoiceRecord, ServeMetrics
from mmpipe.app.serve_protocol import (
    ApiError,
    Job,
    bad,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    parse_chat,
    parse_completion,
    usage,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmpipe.config import SamplingParams
from mmpipe.errors import InputError, MmpipeError
from mmpipe.text_stream import TextStream

log = logging.getLogger("mmpipe.serve")
RETRY_AFTER_S = 1
SHUTDOWN_JOIN_S = 10.0


class Outbox:
    """Events from other threads for the event loop's queues, handed over in batches: one wake-up
    of the loop (`call_soon_threadsafe`, a write to its pipe) for all that arrives before it runs,
    not one per token of every choice."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, tuple]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, queue: asyncio.Queue, event: tuple) -> None:
        with self._lock:
            self._items.append((queue, event))
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
        for queue, event in items:
            queue.put_nowait(event)


class Generation:
    """One choice. A worker thread makes its TextStream (renders the chat, decodes the images) and
    subscribes to it; from then on the Pipeline's stream loop calls `_on_text` after every step
    that brings text, on its own thread, and no thread waits for the choice. Its events go to the
    job's queue as (index, kind, ...) tuples: ("ready",), ("error", exc), ("delta", text,
    token_ids, logprobs), ("end", RequestOutput, tokens)."""

    def __init__(self, server: Server, index: int, make_stream: Callable[[], TextStream],
                 queue: asyncio.Queue, outbox: Outbox, record: ChoiceRecord) -> None:
        self.server, self.index, self.make_stream, self.record = server, index, make_stream, record
        self.queue, self.outbox = queue, outbox
        self.cancel = threading.Event()
        self.ended = threading.Event()  # its stream is over (or never started) and it is released
        self.stream: TextStream | None = None
        self.seen = 0  # tokens handed on
        self.thread = threading.Thread(target=self._start, name=f"mmpipe-serve-{index}", daemon=True)

    def stop(self) -> None:
        """Cancel this choice from any thread without waiting: its request is aborted before the
        engine's next step."""
        self.cancel.set()
        if self.stream is not None:
            self.stream.abort()

    def _put(self, *event: Any) -> None:
        self.outbox.put(self.queue, (self.index, *event))

    def _start(self) -> None:
        try:
            stream = self.make_stream()
        except Exception as exc:  # noqa: BLE001 (handed to the request's handler)
            self.record.end("error")
            self._put("error", exc)
            self._release()
            return
        self.stream = stream
        if self.cancel.is_set():  # stopped while the stream was being made
            stream.abort()
        try:
            stream.subscribe(self._on_text)  # first: the prefill starts while the answer's head is sent
        except Exception as exc:  # noqa: BLE001 (the pipeline is closing)
            self.record.end("error")
            self._put("error", exc)
            self._release()
            return
        self._put("ready")

    def _on_text(self, delta: Any, done: bool) -> None:
        """The stream loop's call (its thread): new text, the end, or a failed step (`delta` is
        then the exception)."""
        stream = self.stream
        assert stream is not None
        try:
            if isinstance(delta, BaseException):
                log.error("a request failed while generating: %s", delta)
                self.record.end("error")
                self._put("error", delta)
                return
            if delta and not self.cancel.is_set():
                ids, lps = stream.tokens_since(self.seen)  # the tokens behind this text, as the engine has them now
                self.seen += len(ids)
                self.record.progress(stream, self.seen)
                self._put("delta", delta, ids, lps)
            if done:
                out = stream.output()
                self.record.end(out.finish_reason, out)  # "abort" when it was stopped unfinished
                if not self.cancel.is_set():
                    self._put("end", out, self.seen)
        finally:
            if done:
                self._release()

    def _release(self) -> None:
        self.server.release(self)
        self.ended.set()


class Server:
    """The pipeline, the admission count, and the generations alive (to cancel at shutdown)."""

    def __init__(self, pipe: Any, names: tuple[str, ...], api_key: str | None, allowed: str | None,
                 max_queued: int, max_running: int | None = None) -> None:
        self.pipe, self.names, self.api_key, self.allowed = pipe, names, api_key, allowed
        running = max_running if max_running is not None else pipe.engine_config.max_running_requests
        self.capacity = running + max_queued  # choices held at once: those running plus those waiting
        self.lock = threading.Lock()
        self.alive: set[Generation] = set()
        self.held = 0
        self.metrics = ServeMetrics(pipe, lambda: self.held)
        self.outbox: Outbox | None = None  # made on the event loop's first request

    def admit(self, count: int) -> None:
        with self.lock:
            if self.held + count > self.capacity:
                raise ApiError(503, f"the server is full ({self.held} requests running or waiting); retry later",
                               type_="server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
            self.held += count

    def release(self, generation: Generation) -> None:
        with self.lock:
            self.held -= 1
            self.alive.discard(generation)

    def start(self, makers: list[Callable[[], TextStream]], endpoint: str,
              n: int) -> tuple[list[Generation], asyncio.Queue]:
        """Start one Generation per maker; `n` choices per prompt (the first of each counts its prompt's tokens)."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        if self.outbox is None or self.outbox.loop is not loop:
            self.outbox = Outbox(loop)
        try:
            self.admit(len(makers))
        except ApiError:
            self.metrics.count(endpoint, "rejected", len(makers))
            raise
        gens = [Generation(self, i, make, queue, self.outbox, self.metrics.choice(endpoint, i % n == 0))
                for i, make in enumerate(makers)]
        with self.lock:
            self.alive.update(gens)
        for gen in gens:
            gen.thread.start()
        return gens, queue

    def shutdown(self) -> None:
        """Abort what is still running and wait for its threads (the pipeline is closed after)."""
        with self.lock:
            gens = list(self.alive)
        for gen in gens:
            gen.stop()
        deadline = time.monotonic() + SHUTDOWN_JOIN_S
        for gen in gens:
            gen.ended.wait(max(0.0, deadline - time.monotonic()))

    # -------------------------------------------------------------- what a choice runs

    def chat_maker(self, conversation: list[dict[str, Any]], sampling: SamplingParams) -> Callable[[], TextStream]:
        return lambda: self.pipe.stream(conversation, sampling)

    def prompt_maker(self, prompt: str, sampling: SamplingParams) -> Callable[[], TextStream]:
        return lambda: self.pipe.stream_prompt(prompt, (), sampling)


async def _wait_ready(gens: list[Generation], queue: asyncio.Queue, param: str) -> list[tuple]:
    """Wait until every choice has started (or one failed: then cancel the rest and answer 400);
    returns the events that arrived meanwhile."""
    pending, early = {g.index for g in gens}, []
    while pending:
        event = await queue.get()
        if event[1] == "ready":
            pending.discard(event[0])
        elif event[1] == "error":
            for gen in gens:
                gen.stop()
            exc = event[2]
            if isinstance(exc, InputError):
                raise bad(str(exc), param)
            if isinstance(exc, MmpipeError):
                raise ApiError(400, str(exc))
            raise ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
        else:
            early.append(event)
    return early


async def _events(gens: list[Generation], queue: asyncio.Queue, early: list[tuple]) -> AsyncIterator[tuple]:
    """Every delta and end event until all choices ended; an error mid-generation raises."""
    remaining = len(gens)
    for event in early:
        yield event
        remaining -= event[1] == "end"
    while remaining:
        event = await queue.get()
        if event[1] == "error":
            raise ApiError(500, f"generation failed: {event[2]}", type_="server_error")
        yield event
        remaining -= event[1] == "end"


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


class KeyCheck:
    """Answers 401 to a /v1/ request without `Authorization: Bearer KEY`. A plain ASGI middleware:
    starlette's `@app.middleware("http")` runs the app in a task of its own and pipes every
    streamed chunk through a memory stream, a cost per chunk."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and \
                dict(scope["headers"]).get(b"authorization", b"") != self.expected:
            response = JSONResponse(ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                             "authentication_error", code="invalid_api_key").body(), status_code=401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(pipe: Any, served_model_name: str | None = None, api_key: str | None = None,
               allowed_local_media_path: str | None = None, max_queued: int = 256,
               max_running: int | None = None) -> FastAPI:
    """The app for one Pipeline. `max_running` (default: the engine's max_running_requests) plus
    `max_queued` choices are held at once; past that, 503 with Retry-After."""
    name = served_model_name or os.path.basename(os.path.normpath(pipe.model.path))
    allowed = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None
    server = Server(pipe, (name,), api_key, allowed, max_queued, max_running)
    pipe.prepare_structured_output()  # response_format's first request would otherwise wait for it

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.shutdown)

    app = FastAPI(title="mmpipe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(ApiError(exc.status_code, message, kind).body(), status_code=exc.status_code)

    if api_key is not None:
        app.add_middleware(KeyCheck, api_key=api_key)

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(f"the body is not valid JSON: {exc}") from None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics() -> Response:  # a worker thread: reading the engine's statistics waits for its step
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "mmpipe",
                                             "root": pipe.model.path, "max_model_len": pipe.runner.max_model_len}
                                            for n in server.names]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        with server.metrics.refusals("chat"):
            job = parse_chat(await body_of(request), server.names, server.allowed)
        makers = [server.chat_maker(job.conversation, s) for s in job.sampling]
        return await _respond(server, job, makers, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        with server.metrics.refusals("completion"):
            job = parse_completion(await body_of(request), server.names)
        makers = [server.prompt_maker(p, s) for p in job.prompts for s in job.sampling]
        return await _respond(server, job, makers, chat=False)

    return app


async def _respond(server: Server, job: Job, makers: list[Callable[[], TextStream]], chat: bool) -> Any:
    gens, queue = server.start(makers, "chat" if chat else "completion", len(job.sampling))
    try:
        early = await _wait_ready(gens, queue, "messages" if chat else "prompt")
    except BaseException:
        for gen in gens:
            gen.stop()
        raise
    if job.stream:
        return StreamingResponse(_stream(server, job, gens, queue, early, chat), media_type="text/event-stream")
    try:
        return await _whole(server, job, gens, queue, early, chat)
    finally:
        for gen in gens:
            gen.stop()


def _top(job: Job) -> int:
    return job.sampling[0].logprobs or 0


async def _whole(server: Server, job: Job, gens: list[Generation], queue: asyncio.Queue, early: list[tuple],
                 chat: bool) -> dict[str, Any]:
    outputs: dict[int, Any] = {}
    async for event in _events(gens, queue, early):
        if event[1] == "end":
            outputs[event[0]] = event[2]
    tokenizer, n = server.pipe.tokenizer, len(job.sampling)
    choices, completion = [], 0
    for i in range(len(gens)):
        out = outputs[i]
        completion += len(out.token_ids)
        lps = out.logprobs if job.logprobs else None
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text},
                            "logprobs": {"content": chat_logprobs(tokenizer, out.token_ids, lps, _top(job))}
                            if lps is not None else None,
                            "finish_reason": finish_reason(out.finish_reason)})
        else:
            text = (job.prompts[i // n] if job.echo else "") + out.text
            choices.append({"index": i, "text": text, "finish_reason": finish_reason(out.finish_reason),
                            "logprobs": completion_logprobs(tokenizer, out.token_ids, lps, _top(job))
                            if lps is not None else None})
    prompt = sum(outputs[p * n].num_prompt_tokens for p in range(len(gens) // n))
    return {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "object": "chat.completion" if chat else
            "text_completion", "created": job.created, "model": job.model, "choices": choices,
            "usage": usage(prompt, completion)}


async def _stream(server: Server, job: Job, gens: list[Generation], queue: asyncio.Queue, early: list[tuple],
                  chat: bool) -> AsyncIterator[str]:
    tokenizer, n = server.pipe.tokenizer, len(job.sampling)
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id,
            "object": "chat.completion.chunk" if chat else "text_completion", "created": job.created,
            "model": job.model}
    extra = {"usage": None} if job.include_usage else {}

    def chunk(index: int, text: str | None, ids: list[int], lps: list, reason: str | None,
              first: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            logprobs = ({"content": chat_logprobs(tokenizer, ids, lps, _top(job))}
                        if job.logprobs and ids else None)
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            logprobs = completion_logprobs(tokenizer, ids, lps, _top(job)) if job.logprobs and ids else None
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return {**head, "choices": [choice], **extra}

    prompt_tokens, completion = {}, 0
    try:
        for gen in gens:
            if chat:
                yield _sse(chunk(gen.index, None, [], [], None, first=True))
            elif job.echo:
                yield _sse(chunk(gen.index, job.prompts[gen.index // n], [], [], None))
        async for event in _events(gens, queue, early):
            index = event[0]
            if event[1] == "delta":
                yield _sse(chunk(index, event[2], event[3], event[4], None))
                continue
            out, seen = event[2], event[3]
            rest = out.token_ids[seen:]
            rest_lps = out.logprobs[seen:] if out.logprobs else []
            completion += len(out.token_ids)
            prompt_tokens[index // n] = out.num_prompt_tokens
            yield _sse(chunk(index, None, rest, rest_lps, finish_reason(out.finish_reason)))
        if job.include_usage:
            yield _sse({**head, "choices": [], "usage": usage(sum(prompt_tokens.values()), completion)})
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse(exc.body())
    finally:  # also on a client that went away: its requests are aborted, their pages freed
        for gen in gens:
            gen.stop()
