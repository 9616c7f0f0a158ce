"""`mmpipe serve`'s GET /metrics: scraped with urllib before and after real requests made with the
`openai` client, parsed with prometheus-client's own parser; every counter must move by exactly what
the requests did (the bundled model on the CPU)."""

from __future__ import annotations

import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from mmpipe.app.serve import on_loopback as serving
from mmpipe.app.serve_api import create_app
from prometheus_client.parser import text_string_to_metric_families

from mmpipe import Pipeline
from tests.app.test_serve import KEY, SCENE, _data_uri, _image_message

Sample = tuple[str, tuple[tuple[str, str], ...]]


@pytest.fixture(scope="module")
def base(pipe):
    with serving(create_app(pipe, served_model_name="tiny", api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def scrape(base: str) -> dict[Sample, float]:
    """Every sample of /metrics (no key needed), keyed by (name, sorted labels)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        assert response.status == 200 and response.headers["content-type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def settled(base: str, timeout: float = 10.0) -> dict[Sample, float]:
    """A scrape once the server holds no choice: every choice's thread has ended and counted itself
    (a request's answer may reach the client before its last thread has). One scrape more after
    that: a scrape reads the counters before the gauges, so the one that saw none held may have
    read a counter before the last thread's end."""
    deadline = time.monotonic() + timeout
    while value(scrape(base), "mmpipe_num_choices_held"):
        assert time.monotonic() < deadline, "a choice's thread never ended"
        time.sleep(0.02)
    return scrape(base)


def value(samples: dict[Sample, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def moved(before: dict[Sample, float], after: dict[Sample, float], name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def outcomes(before: dict[Sample, float], after: dict[Sample, float], endpoint: str) -> dict[str, float]:
    """How far each outcome's counter moved, only those that did."""
    moves = {o: moved(before, after, "mmpipe_requests_total", endpoint=endpoint, outcome=o)
             for o in ("stop", "length", "abort", "error", "rejected")}
    return {o: m for o, m in moves.items() if m}


def test_two_chats_move_the_counters_by_their_usage_and_timings(client, base):
    before = settled(base)
    start = time.monotonic()
    image = client.chat.completions.create(model="tiny", messages=_image_message(_data_uri(SCENE)), max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    middle = settled(base)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=40, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    wall = time.monotonic() - start
    after = settled(base)
    streamed_usage = chunks[-1].usage
    reasons = [image.choices[0].finish_reason, [c.choices[0].finish_reason for c in chunks if c.choices][-1]]
    assert reasons[0] == "length"
    assert outcomes(before, after, "chat") == {r: float(reasons.count(r)) for r in reasons}
    assert outcomes(before, after, "completion") == {}
    prompts = image.usage.prompt_tokens + streamed_usage.prompt_tokens
    assert moved(before, after, "mmpipe_prompt_tokens_total") == prompts
    generated = [image.usage.completion_tokens, streamed_usage.completion_tokens]
    assert moved(before, after, "mmpipe_generation_tokens_total") == sum(generated) and generated[0] == 6
    assert moved(before, after, "mmpipe_time_to_first_token_seconds_count") == 2
    assert moved(before, after, "mmpipe_e2e_request_latency_seconds_count") == 2
    assert moved(before, after, "mmpipe_time_per_output_token_seconds_count") == sum(g > 1 for g in generated)
    ttft = moved(before, after, "mmpipe_time_to_first_token_seconds_sum")
    e2e = moved(before, after, "mmpipe_e2e_request_latency_seconds_sum")
    tpot = moved(before, after, "mmpipe_time_per_output_token_seconds_sum")
    assert 0 < ttft < e2e < wall  # seconds, each request's own, within what the client waited
    assert 0 < tpot * (generated[0] - 1) < e2e  # per token after the first, not per request
    one = {name: moved(before, middle, f"mmpipe_{name}_seconds_sum")  # the image chat's, as the engine timed it
           for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency")}
    assert one["e2e_request_latency"] == pytest.approx(one["time_to_first_token"] + 5 * one["time_per_output_token"])
    assert moved(before, after, "mmpipe_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert moved(before, after, "mmpipe_eager_runs_total", runner="decode") > 0  # the CPU runs no graphs
    assert moved(before, after, "mmpipe_graph_runs_total", runner="decode") == 0
    assert value(after, "mmpipe_num_requests_running") == 0 and value(after, "mmpipe_kv_pages_used") == 0


def test_completions_with_n_count_every_choice_and_each_prompt_once(client, base):
    before = settled(base)
    reply = client.completions.create(model="tiny", prompt=["A photo of", "<|im_start|>user\nHi<|im_end|>\n"],
                                      n=2, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    after = settled(base)
    assert len(reply.choices) == 4 and reply.usage.completion_tokens == 16
    assert outcomes(before, after, "completion") == {"length": 4.0}
    assert moved(before, after, "mmpipe_prompt_tokens_total") == reply.usage.prompt_tokens
    assert moved(before, after, "mmpipe_generation_tokens_total") == 16
    assert moved(before, after, "mmpipe_time_to_first_token_seconds_count") == 4
    assert moved(before, after, "mmpipe_time_per_output_token_seconds_count") == 4
    ttft, tpot, e2e = (moved(before, after, f"mmpipe_{name}_seconds_sum")  # every choice: first token, then 3
                       for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"))
    assert e2e == pytest.approx(ttft + 3 * tpot) and 0 < ttft < e2e


def test_an_aborted_stream_counts_as_abort_and_the_gauges_follow_it(client, base, pipe):
    """The client goes away while its request makes tokens without text (the tiny model's answer
    to "hi" is a few words, then end-of-turn tokens that ignore_eos keeps going): the request is
    aborted at once all the same, not when it would have ended."""
    before = settled(base)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2000, extra_body={"ignore_eos": True}, stream=True)
    for pieces, _ in enumerate(stream, 1):
        if pieces == 5:
            break
    during = scrape(base)
    assert value(during, "mmpipe_num_requests_running") == 1 and value(during, "mmpipe_num_choices_held") == 1
    assert value(during, "mmpipe_num_requests_waiting") == 0
    assert 0 < value(during, "mmpipe_kv_pages_used") < value(during, "mmpipe_kv_pages_total")
    assert value(during, "mmpipe_kv_pages_total") == pipe.stats()["kv_pages"]["total"]
    assert moved(before, during, "mmpipe_time_to_first_token_seconds_count") == 1  # observed at the first token
    assert moved(before, during, "mmpipe_generation_tokens_total") >= 3  # counted as they stream
    decoded = pipe.stats()["runner"]["decode_tokens"]
    while pipe.stats()["runner"]["decode_tokens"] < decoded + 100:  # well past its text
        time.sleep(0.02)
    stream.close()
    after = settled(base, timeout=5)  # its thread has seen the disconnect, aborted and counted it
    assert outcomes(before, after, "chat") == {"abort": 1.0}
    assert moved(before, after, "mmpipe_e2e_request_latency_seconds_count") == 0  # latencies: finished ones only
    assert moved(before, after, "mmpipe_time_to_first_token_seconds_count") == 1
    generated = moved(before, after, "mmpipe_generation_tokens_total")
    assert moved(before, during, "mmpipe_generation_tokens_total") + 100 <= generated < 2000
    assert moved(before, after, "mmpipe_prompt_tokens_total") > 0
    assert value(after, "mmpipe_kv_pages_used") == 0 and value(after, "mmpipe_num_requests_running") == 0


def test_a_request_beyond_the_batch_size_counts_as_waiting():
    long = {"model": "tiny", "max_tokens": 2000, "extra_body": {"ignore_eos": True}, "stream": True}
    with Pipeline.from_pretrained(device="cpu", max_running_requests=1) as one, \
            serving(create_app(one, served_model_name="tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        first = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **long)
        next(iter(first))
        second = client.completions.create(prompt="A photo of", **long)  # answers once its stream is made
        deadline = time.monotonic() + 10
        while value(now := scrape(url), "mmpipe_num_requests_waiting") != 1:
            assert time.monotonic() < deadline, "the second request never waited"
            time.sleep(0.02)
        assert value(now, "mmpipe_num_requests_running") == 1 and value(now, "mmpipe_num_choices_held") == 2
        first.close()
        second.close()
        after = settled(url)
    assert outcomes(now, after, "chat") == {"abort": 1.0} and outcomes(now, after, "completion") == {"abort": 1.0}
    assert value(after, "mmpipe_num_requests_waiting") == 0 and value(after, "mmpipe_kv_pages_used") == 0


def test_refused_and_failed_requests_count_as_errors_and_a_full_server_as_rejected(client, base, pipe):
    before = settled(base)
    with pytest.raises(openai.BadRequestError):  # refused while reading the body: no choice ran
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):  # an unreadable image: both choices fail as they start
        client.chat.completions.create(model="tiny", n=2, max_tokens=4,
                                       messages=_image_message("data:image/png;base64,AAAA"))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    with pytest.raises(openai.AuthenticationError):  # not a request for the model: not counted
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}])
    after = settled(base)
    assert outcomes(before, after, "chat") == {"error": 3.0}
    assert outcomes(before, after, "completion") == {"error": 1.0}
    assert moved(before, after, "mmpipe_prompt_tokens_total") == 0
    assert moved(before, after, "mmpipe_time_to_first_token_seconds_count") == 0

    with serving(create_app(pipe, served_model_name="tiny", max_queued=0, max_running=1)) as url:
        fresh = scrape(url)  # an app of its own: its counters start at zero beside the first app's
        assert value(fresh, "mmpipe_requests_total", endpoint="chat", outcome="error") == 0
        assert value(fresh, "mmpipe_generation_tokens_total") == 0
        small = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        long = small.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=1500, extra_body={"ignore_eos": True}, stream=True)
        next(iter(long))
        with pytest.raises(openai.APIStatusError) as info:
            small.completions.create(model="tiny", prompt="hi", max_tokens=2, n=3)
        assert info.value.status_code == 503
        full = scrape(url)
        long.close()
    assert outcomes(fresh, full, "completion") == {"rejected": 3.0}
    assert outcomes(fresh, full, "chat") == {}
    assert outcomes(after, settled(base), "chat") == {}  # the other app's counters did not move

