"""`mmpipe serve` under load: 64 streaming `openai` clients at once on loopback (the bundled model on
the CPU, greedy), a mix of text and image chats and text completions of different lengths. Every
streamed answer must equal the same request sent alone afterwards, the engine must really have run
them together, and /health and /metrics must answer throughout."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from mmpipe.app.serve import on_loopback as serving
from mmpipe.app.serve_api import create_app

from tests.app.test_serve import SCENE, _data_uri, _image_message
from tests.app.test_serve_metrics import moved, scrape, settled, value

CLIENTS = 64
LIMIT_S = 240.0  # the whole concurrent phase, on a small CI machine


@dataclass
class Answer:
    text: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None


def requests() -> list[dict[str, Any]]:
    """64 different requests: every 8th chat carries the sample image, every 8th (offset) is a text
    completion, the rest text chats; 8 to 32 new tokens, two thirds of them forced to their length
    (ignore_eos: the tiny model's text answers are short, and long ones overlap more)."""
    image = _data_uri(SCENE)
    out = []
    for i in range(CLIENTS):
        body: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_tokens": 8 + 8 * (i % 4)}
        if i % 3:
            body["extra_body"] = {"ignore_eos": True}
        if i % 8 == 0:
            body["messages"] = _image_message(image, f"Describe this image, part {i}.")
        elif i % 8 == 5:
            body["prompt"] = f"A photo of scene {i} with"
        else:
            body["messages"] = [{"role": "user", "content": f"Tell me about scene {i}."}]
        out.append(body)
    return out


async def streamed(client: openai.AsyncOpenAI, body: dict[str, Any]) -> Answer:
    """One request streamed: its joined text, its usage and its finish reason."""
    chat = "messages" in body
    create = client.chat.completions.create if chat else client.completions.create
    stream = await create(stream=True, stream_options={"include_usage": True}, **body)
    text, reason, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append((choice.delta.content if chat else choice.text) or "")
            reason = choice.finish_reason or reason
    assert usage is not None, "no usage chunk"
    return Answer("".join(text), usage.completion_tokens, usage.prompt_tokens, reason)


def alone(client: openai.OpenAI, body: dict[str, Any]) -> Answer:
    """The same request, whole (not streamed), with nothing else running."""
    if "messages" in body:
        reply = client.chat.completions.create(**body)
        text = reply.choices[0].message.content
    else:
        reply = client.completions.create(**body)
        text = reply.choices[0].text
    return Answer(text, reply.usage.completion_tokens, reply.usage.prompt_tokens, reply.choices[0].finish_reason)


class Watcher(threading.Thread):
    """Polls /health and /metrics while the load runs: the peak of running requests and of choices
    held, and every health answer's status and whether it came while requests were held."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.done = base, threading.Event()
        self.peak_running = self.peak_held = 0.0
        self.health: list[tuple[int, float]] = []  # (status, choices held at the scrape just before)
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.done.is_set():
                samples = scrape(self.base)
                held = value(samples, "mmpipe_num_choices_held")
                self.peak_running = max(self.peak_running, value(samples, "mmpipe_num_requests_running"))
                self.peak_held = max(self.peak_held, held)
                with urllib.request.urlopen(self.base + "/health", timeout=30) as response:
                    self.health.append((response.status, held))
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            self.failure = exc


@pytest.fixture(scope="module")
def base(engine):
    with serving(create_app(engine, served_model_name="tiny")) as url:
        yield url


@pytest.mark.slow
def test_64_streaming_clients_at_once_each_equal_to_its_request_alone(base, engine):
    assert engine.max_running_requests >= CLIENTS  # the batch can hold them all
    bodies = requests()
    before = settled(base)
    steps = engine.stats()["steps"]
    watcher = Watcher(base)
    watcher.start()

    async def everyone() -> list[Answer]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=LIMIT_S)
        try:
            return await asyncio.wait_for(asyncio.gather(*(streamed(client, b) for b in bodies)), LIMIT_S)
        finally:
            await client.close()

    start = time.monotonic()
    try:
        together = asyncio.run(everyone())
    finally:
        watcher.done.set()
        watcher.join(30)
    elapsed = time.monotonic() - start
    after = settled(base)
    assert elapsed < LIMIT_S
    assert watcher.failure is None, f"/health or /metrics failed under load: {watcher.failure!r}"
    assert watcher.health and all(status == 200 for status, _ in watcher.health)
    assert any(held > 1 for _, held in watcher.health), "no health answer came while the load ran"
    assert watcher.peak_running > 1 and watcher.peak_held > 1  # they ran together, not one by one
    generated = sum(a.completion_tokens for a in together)
    assert engine.stats()["steps"] - steps < generated  # batched: fewer engine steps than tokens
    assert moved(before, after, "mmpipe_generation_tokens_total") == generated
    assert moved(before, after, "mmpipe_time_to_first_token_seconds_count") == CLIENTS

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    one_by_one = [alone(client, body) for body in bodies]
    for i, (streamed_answer, single) in enumerate(zip(together, one_by_one)):
        assert streamed_answer == single, f"request {i}: {bodies[i].get('messages') or bodies[i]['prompt']!r}"
    assert sum(a.text != "" for a in together) > CLIENTS // 2  # answers with text, not empty ones
    assert {a.finish_reason for a in together} == {"length", "stop"}
