"""`mmpipe bench serve`'s load and statistics: Poisson arrivals under a concurrency cap, driven
either through the HTTP server (`drive_server`: streaming chat completions from
`openai.AsyncOpenAI` or the bare client of `http_client`, in a process of its own,
`LoadProcess`) or straight through `Pipeline.stream` on one thread per request, as the server
runs them (`drive_api`); and what a run's records give (`summarise`): TTFT, TPOT, inter-token
latency and end-to-end latency (mean, p50, p90, p99), request and output token throughput.

Every time is a `time.perf_counter()` reading (one clock for every process of the machine), in
seconds from the run's start. A chunk is timed when it arrives, before it is parsed. Either
client hands over the SSE lines (the SDK's `with_streaming_response`) and each is parsed with
`json.loads`: the openai SDK's typed chunk objects cost the client far more CPU per chunk than
the server spends sending it, so a client that built them would measure itself at high token
rates. The CPU share of the run of the busiest load process (`client_cpu_share`) says whether the
load kept up.

This module imports neither torch nor the server, so the load process starts quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

START_MARGIN_S = 0.25  # the load processes start this long after their requests are handed out
CLIENT_TIMEOUT_S = 3600.0  # one request's limit in the load generator (a slow point is measured, not cut)


@dataclass
class Record:
    """One request as its client saw it (seconds from the run's start)."""

    sent: float = 0.0  # when the request was sent (after its arrival and a free concurrency slot)
    chunks: list[float] = field(default_factory=list)  # arrival of every chunk that carries text
    end: float = 0.0  # when the stream ended
    tokens: int = 0  # tokens generated (the server's usage; the stream's count through the API)
    prompt_tokens: int = 0
    error: str | None = None


@dataclass
class Run:
    records: list[Record]
    wall_s: float  # from the run's start to the last request's end
    cpu_s: float | None = None  # CPU seconds of the (busiest) load generator's process (None: not measured)


# ------------------------------------------------------------------ arrivals and requests


def arrival_offsets(count: int, rate: float, seed: int = 0) -> list[float]:
    """When each of `count` requests arrives, in seconds from the start: a Poisson process of
    `rate` requests per second (exponential gaps, seeded), or all at once for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng, at, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        offsets.append(at)
    return offsets


def chat_body(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One benchmark request as the server receives it: greedy, exactly `max_tokens` new tokens
    (`ignore_eos`), streamed with a last usage chunk."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# ------------------------------------------------------------------ statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 to 100), linear between the closest ranks; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 of `values` (None each when there are none)."""
    mean = sum(values) / len(values) if values else None
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def summarise(run: Run) -> dict[str, Any]:
    """A run's figures, latencies in ms. TTFT: from sending to the first chunk with text. TPOT:
    (end - first text) / (tokens - 1), for requests of two tokens or more. ITL: every gap between
    consecutive chunks with text. E2E: from sending to the stream's end. Throughputs count the
    requests that completed, over the run's wall time."""
    done = [r for r in run.records if r.error is None]
    timed = [r for r in done if r.chunks]
    tokens = sum(r.tokens for r in done)
    chunks = sum(len(r.chunks) for r in done)
    errors = [r.error for r in run.records if r.error is not None]
    wall = run.wall_s
    return {
        "requests": len(run.records), "completed": len(done), "errors": len(errors),
        "first_error": errors[0] if errors else None, "without_text": len(done) - len(timed),
        "wall_s": wall, "output_tokens": tokens,
        "prompt_tokens_mean": sum(r.prompt_tokens for r in done) / len(done) if done else None,
        "request_throughput": len(done) / wall if wall > 0 else None,
        "output_throughput": tokens / wall if wall > 0 else None,
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "ttft_ms": distribution([(r.chunks[0] - r.sent) * 1000 for r in timed]),
        "tpot_ms": distribution([(r.end - r.chunks[0]) / (r.tokens - 1) * 1000 for r in timed if r.tokens > 1]),
        "itl_ms": distribution([(b - a) * 1000 for r in timed for a, b in zip(r.chunks, r.chunks[1:])]),
        "e2e_ms": distribution([(r.end - r.sent) * 1000 for r in done]),
        "client_cpu_share": run.cpu_s / wall if run.cpu_s is not None and wall > 0 else None,
    }


# ------------------------------------------------------------------ through the server


def _post(client: Any, body: dict[str, Any] | bytes) -> Any:
    """The streamed request: through the openai SDK, or (`--client raw`, `BareHttpClient`) as the
    bytes encoded before the run: the client's own work per request is then only writing them."""
    if isinstance(body, bytes):
        return client.stream(body)
    return client.chat.completions.with_streaming_response.create(
        model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"],
        temperature=body["temperature"], stream=True, stream_options=body["stream_options"],
        extra_body={"ignore_eos": body["ignore_eos"]})


async def _stream_one(client: Any, body: dict[str, Any] | bytes, record: Record, start: float) -> None:
    record.sent = time.perf_counter() - start
    try:
        async with _post(client, body) as response:
            if getattr(response, "status_code", 200) != 200:
                record.error = f"HTTP {response.status_code}"
            async for line in response.aiter_lines() if hasattr(response, "aiter_lines") else response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter() - start
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = str(event["error"].get("message"))
                    break
                if any((choice.get("delta") or {}).get("content") for choice in event.get("choices") or ()):
                    record.chunks.append(now)
                if event.get("usage"):
                    record.tokens = event["usage"]["completion_tokens"]
                    record.prompt_tokens = event["usage"]["prompt_tokens"]
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, the run goes on)
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter() - start


async def drive_server(client: Any, bodies: Sequence[dict[str, Any]], offsets: Sequence[float],
                       concurrency: int | None, start_at: float | None = None) -> Run:
    """Send `bodies` with `client` (an `openai.AsyncOpenAI`, or a `BareHttpClient`), each
    at its arrival offset, at most `concurrency` at once (None: no cap); a request that arrives
    while every slot is taken waits for one, and its times count from when it is sent. Offsets
    count from `start_at` (a `time.perf_counter()` reading, shared by every process of the machine)
    when given, else from now."""
    records = [Record() for _ in bodies]
    slots = asyncio.Semaphore(concurrency or max(1, len(bodies)))
    payloads = list(bodies) if hasattr(client, "chat") else [client.encode("chat/completions", json.dumps(b).encode())
                                                             for b in bodies]
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    cpu, start = time.process_time(), start_at if start_at is not None else time.perf_counter()

    async def one(i: int) -> None:
        async with slots:
            await _stream_one(client, payloads[i], records[i], start)

    tasks = []
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return Run(records, max((r.end for r in records), default=0.0), time.process_time() - cpu)


def _load_loop(conn: Any, base_url: str, api_key: str, kind: str = "openai") -> None:
    """The load process: one event loop and one client (its connections kept across runs)."""
    loop = asyncio.new_event_loop()

    async def make_client() -> Any:
        if kind == "raw":
            from mmpipe.app.bench.http_client import BareHttpClient

            return BareHttpClient(base_url, api_key, CLIENT_TIMEOUT_S)
        import openai

        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=CLIENT_TIMEOUT_S)

    client = loop.run_until_complete(make_client())
    try:
        while (job := conn.recv()) is not None:
            try:
                conn.send((loop.run_until_complete(drive_server(client, *job)), None))
            except Exception:  # noqa: BLE001 (the parent raises it)
                conn.send((None, traceback.format_exc()))
    finally:
        loop.run_until_complete(client.aclose() if hasattr(client, "aclose") else client.close())
        loop.close()


class LoadProcess:
    """`drive_server` in `processes` processes of its own (spawned, so they share nothing with the
    server's process: the client's parsing never holds the server's interpreter lock). One asyncio
    process reading many fast streams falls behind them; several share the requests round-robin
    and the concurrency cap (never more processes than the cap), start together and their records
    are merged in request order. `cpu_s` is the busiest process's."""

    def __init__(self, base_url: str, api_key: str = "none", client: str = "openai", processes: int = 1) -> None:
        context = multiprocessing.get_context("spawn")
        self._children: list[tuple[Any, Any]] = []
        for i in range(processes):
            conn, child = context.Pipe()
            process = context.Process(target=_load_loop, args=(child, base_url, api_key, client), daemon=True,
                                      name=f"mmpipe-bench-load-{i}")
            process.start()
            child.close()
            self._children.append((conn, process))

    def run(self, bodies: Sequence[dict[str, Any]], offsets: Sequence[float], concurrency: int | None) -> Run:
        count = max(1, min(len(self._children), len(bodies), concurrency or len(bodies)))
        used = self._children[:count]
        start_at = time.perf_counter() + START_MARGIN_S
        for j, (conn, process) in enumerate(used):
            cap = None if concurrency is None else concurrency // count + (j < concurrency % count)
            try:
                conn.send((list(bodies[j::count]), list(offsets[j::count]), cap, start_at))
            except (EOFError, OSError) as exc:
                raise RuntimeError(f"a load generator's process ended (exit code {process.exitcode})") from exc
        records: list[Record | None] = [None] * len(bodies)
        wall, cpu = 0.0, 0.0
        for j, (conn, process) in enumerate(used):
            try:
                run, failure = conn.recv()
            except (EOFError, OSError) as exc:
                raise RuntimeError(f"a load generator's process ended (exit code {process.exitcode})") from exc
            if failure is not None:
                raise RuntimeError(f"the load generator failed:\n{failure}")
            records[j::count] = run.records
            wall, cpu = max(wall, run.wall_s), max(cpu, run.cpu_s or 0.0)
        return Run([r for r in records if r is not None], wall, cpu)

    def close(self) -> None:
        for conn, process in self._children:
            if process.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        for conn, process in self._children:
            process.join(30)
            if process.is_alive():
                process.terminate()
            conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ through the Python API


def _api_one(pipe: Any, job: tuple[Any, Any], record: Record, start: float, slots: threading.Semaphore) -> None:
    try:
        stream = pipe.stream(*job)
        try:
            for delta in stream:
                if delta:
                    record.chunks.append(time.perf_counter() - start)
            record.tokens, record.prompt_tokens = stream.num_generated_tokens, stream.num_prompt_tokens
        finally:
            stream.close()
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, the run goes on)
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.end = time.perf_counter() - start
        slots.release()


def drive_api(pipe: Any, jobs: Sequence[tuple[Any, Any]], offsets: Sequence[float], concurrency: int | None) -> Run:
    """`drive_server`'s load through `pipe.stream(conversation, sampling)` for each job, each on
    a thread of its own that iterates its stream (and so steps the shared engine), as the
    server's request threads do."""
    records = [Record() for _ in jobs]
    slots = threading.Semaphore(concurrency or max(1, len(jobs)))
    threads = []
    start = time.perf_counter()
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        slots.acquire()
        records[i].sent = time.perf_counter() - start  # the thread's start counts, as in the server
        thread = threading.Thread(target=_api_one, args=(pipe, jobs[i], records[i], start, slots),
                                  name=f"mmpipe-bench-api-{i}", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return Run(records, max((r.end for r in records), default=0.0))
