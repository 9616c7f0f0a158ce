"""`mmpipe serve`'s FastAPI app: OpenAI's chat and text completions, models, health and metrics, in
front of one Pipeline: in a process of its own (`EngineProcess`, app/serve_engine.py: what `mmpipe
serve` runs) or in this one (`LocalEngine`, app/serve_choices.py: an app that embeds the server).

Every choice is a `TextStream` beside the Pipeline: a worker thread there renders the chat,
decodes the media and subscribes to it; the Pipeline's stream loop steps the shared engine for
every stream (so all requests are batched together), and each step's new text comes to this
event loop as events (`Choice.receive`), which never waits on the engine or on media decoding.
A client that disconnects stops its choices: their streams are aborted before the engine's next
step (even while their tokens make no text), which frees their KV pages. Each choice also feeds
its metrics (app/serve_metrics.py: its first token, its tokens, its end); GET /metrics reads them
and the engine's statistics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from mmpipe.app.serve_choices import LocalEngine
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

log = logging.getLogger("mmpipe.serve")
RETRY_AFTER_S = 1
SHUTDOWN_JOIN_S = 10.0


class Choice:
    """One choice, as the server sees it: its events arrive on the event loop (`receive`), feed
    its metrics and go to its request's queue as (index, kind, ...) tuples: ("ready",), ("error",
    Failure), ("delta", text, token_ids, logprobs), ("end", RequestOutput, tokens). Once stopped,
    only its end is counted (nobody reads the queue)."""

    def __init__(self, server: Server, index: int, queue: asyncio.Queue, record: ChoiceRecord) -> None:
        self.server, self.index, self.queue, self.record = server, index, queue, record
        self.handle: Any = None  # the engine's handle, to abort it
        self.cancelled = False
        self.ended = threading.Event()  # its end (or failure) has arrived and it is released
        self.seen = 0  # tokens received

    def stop(self) -> None:
        """Cancel this choice from any thread without waiting: its request is aborted before the
        engine's next step."""
        if not self.cancelled and not self.ended.is_set():
            self.cancelled = True
            self.server.engine.abort(self.handle)

    def receive(self, event: tuple) -> None:
        kind = event[0]
        if kind == "delta":
            _, text, ids, lps, first = event
            if first is not None:
                self.record.first_token(*first)
            self.seen += len(ids)
            self.record.tokens(self.seen)
            if not self.cancelled:
                self.queue.put_nowait((self.index, "delta", text, ids, lps))
            return
        if kind == "end":
            out = event[1]
            self.record.end(out.finish_reason, out)  # "abort" when it was stopped unfinished
        elif kind == "error":
            self.record.end("error")
        if not self.cancelled or kind == "ready":
            self.queue.put_nowait((self.index, *event))
        if kind in ("end", "error"):
            self.server.release(self)
            self.ended.set()


class Server:
    """The engine (in this process or its own), the admission count, and the choices alive (to
    cancel at shutdown)."""

    def __init__(self, engine: Any, names: tuple[str, ...], api_key: str | None, allowed: str | None,
                 max_queued: int, max_running: int | None = None) -> None:
        self.engine, self.names, self.api_key, self.allowed = engine, names, api_key, allowed
        running = max_running if max_running is not None else engine.max_running_requests
        self.capacity = running + max_queued  # choices held at once: those running plus those waiting
        self.lock = threading.Lock()
        self.alive: set[Choice] = set()
        self.held = 0
        self.metrics = ServeMetrics(engine, lambda: self.held)

    def admit(self, count: int) -> None:
        with self.lock:
            if self.held + count > self.capacity:
                raise ApiError(503, f"the server is full ({self.held} requests running or waiting); retry later",
                               type_="server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
            self.held += count

    def release(self, choice: Choice) -> None:
        with self.lock:
            self.held -= 1
            self.alive.discard(choice)

    def start(self, works: list[tuple[str, Any, SamplingParams]], endpoint: str,
              n: int) -> tuple[list[Choice], asyncio.Queue]:
        """Start one choice per (kind, payload, sampling); `n` choices per prompt (the first of each
        counts its prompt's tokens)."""
        queue: asyncio.Queue = asyncio.Queue()
        try:
            self.admit(len(works))
        except ApiError:
            self.metrics.count(endpoint, "rejected", len(works))
            raise
        choices = [Choice(self, i, queue, self.metrics.choice(endpoint, i % n == 0)) for i in range(len(works))]
        with self.lock:
            self.alive.update(choices)
        for choice, (kind, payload, sampling) in zip(choices, works):
            choice.handle = self.engine.start(choice, kind, payload, sampling)
        return choices, queue

    def shutdown(self) -> None:
        """Abort what is still running and wait for the ends (the engine is closed after)."""
        with self.lock:
            choices = list(self.alive)
        for choice in choices:
            choice.stop()
        deadline = time.monotonic() + SHUTDOWN_JOIN_S
        for choice in choices:
            choice.ended.wait(max(0.0, deadline - time.monotonic()))


async def _wait_ready(choices: list[Choice], queue: asyncio.Queue, param: str) -> list[tuple]:
    """Wait until every choice has started (or one failed: then cancel the rest and answer 400);
    returns the events that arrived meanwhile."""
    pending, early = {c.index for c in choices}, []
    while pending:
        event = await queue.get()
        if event[1] == "ready":
            pending.discard(event[0])
        elif event[1] == "error":
            for choice in choices:
                choice.stop()
            failure = event[2]
            if failure.kind == "input":
                raise bad(failure.message, param)
            if failure.kind == "mmpipe":
                raise ApiError(400, failure.message)
            raise ApiError(500, f"internal error: {failure.message}", type_="server_error")
        else:
            early.append(event)
    return early


async def _events(choices: list[Choice], queue: asyncio.Queue, early: list[tuple]) -> AsyncIterator[tuple]:
    """Every delta and end event until all choices ended; an error mid-generation raises."""
    remaining = len(choices)
    for event in early:
        yield event
        remaining -= event[1] == "end"
    while remaining:
        event = await queue.get()
        if event[1] == "error":
            raise ApiError(500, f"generation failed: {event[2].message}", type_="server_error")
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


def create_app(engine: Any, served_model_name: str | None = None, api_key: str | None = None,
               allowed_local_media_path: str | None = None, max_queued: int = 256,
               max_running: int | None = None) -> FastAPI:
    """The app in front of `engine`: a Pipeline (run in this process, `LocalEngine`) or an
    `EngineProcess` (`mmpipe serve`); the app does not close either. `max_running` (default: the
    engine's max_running_requests) plus `max_queued` choices are held at once; past that, 503
    with Retry-After."""
    if not hasattr(engine, "attach"):
        engine = LocalEngine(engine)
    name = served_model_name or os.path.basename(os.path.normpath(engine.model_path))
    allowed = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None
    server = Server(engine, (name,), api_key, allowed, max_queued, max_running)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.attach()
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.shutdown)
        await engine.aclose()

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
    async def health() -> Any:
        if not getattr(engine, "alive", True):
            return JSONResponse({"status": "engine down", "reason": engine.failure}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics() -> Response:  # a worker thread: reading the engine's statistics waits for its step
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "mmpipe",
                                             "root": engine.model_path, "max_model_len": engine.max_model_len}
                                            for n in server.names]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        with server.metrics.refusals("chat"):
            job = parse_chat(await body_of(request), server.names, server.allowed)
        return await _respond(server, job, [("chat", job.conversation, s) for s in job.sampling], chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        with server.metrics.refusals("completion"):
            job = parse_completion(await body_of(request), server.names)
        works = [("prompt", p, s) for p in job.prompts for s in job.sampling]
        return await _respond(server, job, works, chat=False)

    return app


async def _respond(server: Server, job: Job, works: list[tuple[str, Any, SamplingParams]], chat: bool) -> Any:
    choices, queue = server.start(works, "chat" if chat else "completion", len(job.sampling))
    try:
        early = await _wait_ready(choices, queue, "messages" if chat else "prompt")
    except BaseException:
        for choice in choices:
            choice.stop()
        raise
    if job.stream:
        return StreamingResponse(_stream(server, job, choices, queue, early, chat), media_type="text/event-stream")
    try:
        return await _whole(server, job, choices, queue, early, chat)
    finally:
        for choice in choices:
            choice.stop()


def _top(job: Job) -> int:
    return job.sampling[0].logprobs or 0


async def _whole(server: Server, job: Job, choices: list[Choice], queue: asyncio.Queue, early: list[tuple],
                 chat: bool) -> dict[str, Any]:
    outputs: dict[int, Any] = {}
    async for event in _events(choices, queue, early):
        if event[1] == "end":
            outputs[event[0]] = event[2]
    tokenizer, n = server.engine.tokenizer, len(job.sampling)
    answers, completion = [], 0
    for i in range(len(choices)):
        out = outputs[i]
        completion += len(out.token_ids)
        lps = out.logprobs if job.logprobs else None
        if chat:
            answers.append({"index": i, "message": {"role": "assistant", "content": out.text},
                            "logprobs": {"content": chat_logprobs(tokenizer, out.token_ids, lps, _top(job))}
                            if lps is not None else None,
                            "finish_reason": finish_reason(out.finish_reason)})
        else:
            text = (job.prompts[i // n] if job.echo else "") + out.text
            answers.append({"index": i, "text": text, "finish_reason": finish_reason(out.finish_reason),
                            "logprobs": completion_logprobs(tokenizer, out.token_ids, lps, _top(job))
                            if lps is not None else None})
    prompts = [[outputs[p * n + i] for i in range(n)] for p in range(len(choices) // n)]  # by prompt
    return {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "object": "chat.completion" if chat else
            "text_completion", "created": job.created, "model": job.model, "choices": answers,
            "usage": usage(sum(o[0].num_prompt_tokens for o in prompts), completion,
                           sum(min(c.num_cached_tokens for c in o) for o in prompts))}


async def _stream(server: Server, job: Job, choices: list[Choice], queue: asyncio.Queue, early: list[tuple],
                  chat: bool) -> AsyncIterator[str]:
    tokenizer, n = server.engine.tokenizer, len(job.sampling)
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

    prompt_tokens, cached, completion = {}, {}, 0
    try:
        for choice in choices:
            if chat:
                yield _sse(chunk(choice.index, None, [], [], None, first=True))
            elif job.echo:
                yield _sse(chunk(choice.index, job.prompts[choice.index // n], [], [], None))
        async for event in _events(choices, queue, early):
            index = event[0]
            if event[1] == "delta":
                yield _sse(chunk(index, event[2], event[3], event[4], None))
                continue
            out, seen = event[2], event[3]
            rest = out.token_ids[seen:]
            rest_lps = out.logprobs[seen:] if out.logprobs else []
            completion += len(out.token_ids)
            prompt_tokens[index // n] = out.num_prompt_tokens
            cached[index // n] = min(out.num_cached_tokens, cached.get(index // n, out.num_cached_tokens))
            yield _sse(chunk(index, None, rest, rest_lps, finish_reason(out.finish_reason)))
        if job.include_usage:
            yield _sse({**head, "choices": [], "usage": usage(sum(prompt_tokens.values()), completion,
                                                                      sum(cached.values()))})
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse(exc.body())
    finally:  # also on a client that went away: its requests are aborted, their pages freed
        for choice in choices:
            choice.stop()
