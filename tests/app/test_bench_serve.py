"""`mmpipe bench serve` off the GPU: the statistics on known numbers, the Poisson arrivals, and the
load generator (its own process, the openai client) against the real server and the Python API
driver, on a tiny random checkpoint whose output tokens are all text (as the bench builds them)."""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from mmpipe.app.bench import serve as bench_serve
from mmpipe.app.bench.serve_load import (
    LoadProcess,
    Record,
    Run,
    _stream_one,
    arrival_offsets,
    chat_body,
    drive_api,
    percentile,
    summarise,
)
from mmpipe.app.tiny.synthetic import build_tokenizer, qwen2_5_vl_config

from mmpipe import Pipeline, SamplingParams

TOKENS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """As the bench's shapes: more token ids than the tokenizer has (the others decode to nothing)."""
    tokenizer = build_tokenizer()
    config = qwen2_5_vl_config(tokenizer, text={"vocab_size": 4 * len(tokenizer)})
    return bench_serve.write_text_checkpoint(str(tmp_path_factory.mktemp("text-ckpt")), config, tokenizer)


@pytest.fixture(scope="module")
def tpipe(checkpoint):
    with Pipeline.from_pretrained(checkpoint, device="cpu") as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def load(tpipe):
    with bench_serve.serving(tpipe, 256) as url, LoadProcess(url) as process:
        yield process


def _bodies(pipe, kind: str, count: int, seed: int = 0) -> list[dict]:
    return bench_serve.make_bodies(kind, pipe.tokenizer, count, 24, TOKENS, (112, 84), seed)


def _most_in_flight(records: list[Record]) -> int:
    return max(sum(1 for o in records if o.sent <= r.sent < o.end) for r in records)


# ------------------------------------------------------------------ statistics


def test_percentile_interpolates_between_ranks():
    hundred_and_one = list(range(1, 102))
    assert [percentile(hundred_and_one, q) for q in (0, 50, 90, 99, 100)] == [1, 51, 91, 100, 101]
    four = [40.0, 10.0, 30.0, 20.0]  # unsorted on purpose
    assert percentile(four, 50) == pytest.approx(25.0)
    assert percentile(four, 90) == pytest.approx(37.0)  # rank 2.7: 30 + 0.7 x 10
    assert (percentile(four, 0), percentile(four, 100)) == (10.0, 40.0)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    values = np.random.default_rng(3).exponential(size=257).tolist()
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summarise_follows_the_definitions():
    records = [Record(sent=0.0, chunks=[0.1, 0.15, 0.25], end=0.3, tokens=3, prompt_tokens=10),
               Record(sent=0.5, chunks=[0.52, 0.62], end=0.7, tokens=2, prompt_tokens=20),
               Record(sent=0.2, end=0.4, error="boom")]
    s = summarise(Run(records, wall_s=1.0, cpu_s=0.25))
    assert (s["requests"], s["completed"], s["errors"], s["first_error"]) == (3, 2, 1, "boom")
    assert s["request_throughput"] == pytest.approx(2.0) and s["output_throughput"] == pytest.approx(5.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(60.0) and s["ttft_ms"]["p50"] == pytest.approx(60.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((100.0 + 180.0) / 2)  # (end - first) / (tokens - 1)
    assert s["itl_ms"]["mean"] == pytest.approx((50 + 100 + 100) / 3) and s["itl_ms"]["p50"] == pytest.approx(100)
    assert s["e2e_ms"]["p50"] == pytest.approx(250.0)
    assert s["tokens_per_chunk"] == 1.0 and s["prompt_tokens_mean"] == 15.0 and s["client_cpu_share"] == 0.25


def test_poisson_arrivals_have_exponential_gaps_of_the_rate():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    offsets = arrival_offsets(4000, 10.0, seed=1)
    gaps = np.diff([0.0, *offsets])
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() == pytest.approx(0.1, rel=0.1)  # exponential: the spread equals the mean
    assert arrival_offsets(50, 3.0, seed=2) == arrival_offsets(50, 3.0, seed=2) != arrival_offsets(50, 3.0, seed=3)


def test_overhead_against_the_issue_targets():
    def point(ttft: float, tput: float) -> dict:
        return {"ttft_ms": {"p50": ttft, "mean": ttft + 1}, "output_throughput": tput, "request_throughput": tput / 10}

    close = bench_serve.overhead(point(10.0, 1000.0), point(11.5, 960.0), saturation=True)
    assert close["ttft_p50_ms"]["diff"] == pytest.approx(1.5) and close["ttft_p50_ms"]["diff_pct"] == pytest.approx(15)
    assert close["output_throughput"]["diff_pct"] == pytest.approx(-4.0)
    assert close["ttft_within_target"] and close["throughput_within_target"]  # within the ms, within the share
    share = bench_serve.overhead(point(100.0, 1000.0), point(109.0, 940.0), saturation=True)
    assert share["ttft_within_target"] and not share["throughput_within_target"]
    far = bench_serve.overhead(point(100.0, 1000.0), point(115.0, 1000.0), saturation=False)
    assert not far["ttft_within_target"] and far["throughput_within_target"] is None


def test_arguments_parse():
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--rates", "1,inf", "--concurrency", "1,inf", "--image-size", "640x480"])
    assert args.rates == [1.0, math.inf] and args.concurrency == [1, None] and args.image_size == (640, 480)
    defaults = parser.parse_args([])
    assert defaults.rates == [1.0, 4.0, 16.0, math.inf] and defaults.concurrency == [1, 8, 32]
    assert defaults.prompts == ["text", "image"] and defaults.image_size == (448, 448)
    for bad in (["--rates", "0"], ["--concurrency", "0"], ["--prompts", "video"], ["--image-size", "4x4x4"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


# ------------------------------------------------------------------ the checkpoint


def test_the_text_checkpoint_streams_one_chunk_per_token(tpipe):
    ids = bench_serve.text_token_ids(tpipe.tokenizer)
    assert ids and not set(ids) & set(tpipe.tokenizer.all_special_ids)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(60, 8, generator=generator)
    kept = list(range(1, 60, 3))  # with many kept rows, one of them scores above zero
    bench_serve.keep_rows(weight, kept)
    assert weight[[i for i in range(60) if i not in kept]].eq(0).all() and weight[kept].ne(0).all()
    assert set((torch.randn(500, 8, generator=generator) @ weight.T).argmax(-1).tolist()) <= set(kept)
    for prompt in ("Describe the scene.", "hello"):
        stream = tpipe.stream([{"role": "user", "content": prompt}],
                              SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        deltas = list(stream)
        assert stream.num_generated_tokens == 12 and len(deltas) == 12 and all(deltas)


# ------------------------------------------------------------------ the load


def test_one_at_a_time_through_the_server_every_token_is_timed(tpipe, load):
    bodies = _bodies(tpipe, "text", 4)
    run = load.run(bodies, arrival_offsets(4, math.inf), 1)
    assert [r.error for r in run.records] == [None] * 4
    assert [r.tokens for r in run.records] == [TOKENS] * 4
    assert [len(r.chunks) - 1 for r in run.records] == [TOKENS - 1] * 4  # one gap per token after the first
    for before, after in zip(run.records, run.records[1:]):
        assert after.sent >= before.end  # concurrency 1: the next one waits
    s = summarise(run)
    assert run.wall_s == max(r.end for r in run.records)
    assert s["output_throughput"] == pytest.approx(4 * TOKENS / run.wall_s)
    assert s["request_throughput"] == pytest.approx(4 / run.wall_s)
    assert s["without_text"] == 0 and s["tokens_per_chunk"] == 1.0
    assert 0 < s["client_cpu_share"] <= 1
    ttfts = [r.chunks[0] - r.sent for r in run.records]
    assert s["ttft_ms"]["p50"] == pytest.approx(1000 * statistics.median(ttfts))
    api = drive_api(tpipe, [bench_serve.api_job(b) for b in bodies], arrival_offsets(4, math.inf), 1)
    assert [r.prompt_tokens for r in api.records] == [r.prompt_tokens for r in run.records]  # the same requests
    assert [len(r.chunks) for r in api.records] == [TOKENS] * 4


def test_the_bare_http_client_times_the_same_stream(tpipe, load):
    """`--client raw`: the same requests give the same tokens, chunks and usage as through the SDK."""
    bodies = _bodies(tpipe, "text", 3)
    with bench_serve.serving(tpipe, 256) as url, LoadProcess(url, client="raw") as raw:
        bare = raw.run(bodies, arrival_offsets(3, math.inf), 1)
    sdk = load.run(bodies, arrival_offsets(3, math.inf), 1)
    assert [r.error for r in bare.records] == [None] * 3
    assert [(r.tokens, r.prompt_tokens, len(r.chunks)) for r in bare.records] == \
        [(r.tokens, r.prompt_tokens, len(r.chunks)) for r in sdk.records] == [(TOKENS, r.prompt_tokens, TOKENS)
                                                                             for r in sdk.records]


def test_the_bare_client_reuses_its_connection_and_reports_a_refusal(tpipe):
    """Requests one after another go over one kept-alive connection; a refused request is an
    error of its record, and the connection still serves the next one."""
    import asyncio
    import json

    from mmpipe.app.bench.http_client import BareHttpClient

    good = _bodies(tpipe, "text", 2)
    refused = {**good[0], "model": "no-such-model"}

    async def send_all(url: str) -> tuple[list[Record], int]:
        client = BareHttpClient(url, "none")
        records = [Record() for _ in range(3)]
        for body, record in zip([good[0], refused, good[1]], records):
            await _stream_one(client, client.encode("chat/completions", json.dumps(body).encode()), record, 0.0)
        idle = len(client._idle)
        await client.aclose()
        return records, idle

    with bench_serve.serving(tpipe, 256) as url:
        records, idle = asyncio.run(send_all(url))
    assert records[1].error is not None and records[1].error.startswith("HTTP 4") and not records[1].chunks
    assert [r.error for r in (records[0], records[2])] == [None, None]
    assert [r.tokens for r in (records[0], records[2])] == [TOKENS, TOKENS]
    assert [len(r.chunks) for r in (records[0], records[2])] == [TOKENS, TOKENS]
    assert idle == 1  # one connection carried all three


@pytest.mark.parametrize("via", ["server", "api"])
def test_arrivals_and_the_concurrency_cap_hold(tpipe, load, via):
    bodies = _bodies(tpipe, "image", 6, seed=1)
    offsets = arrival_offsets(6, 40.0, seed=5)
    if via == "server":
        run = load.run(bodies, offsets, 2)
    else:
        run = drive_api(tpipe, [bench_serve.api_job(b) for b in bodies], offsets, 2)
    assert [r.error for r in run.records] == [None] * 6 and [r.tokens for r in run.records] == [TOKENS] * 6
    assert all(r.sent >= offset - 1e-3 for r, offset in zip(run.records, offsets))  # never before it arrives
    assert _most_in_flight(run.records) <= 2
    assert all(len(r.chunks) >= 1 for r in run.records)
    burst = bodies[:4]
    crowd = load.run(burst, [0.0] * 4, 2) if via == "server" else drive_api(
        tpipe, [bench_serve.api_job(b) for b in burst], [0.0] * 4, 2)
    assert _most_in_flight(crowd.records) == 2


def test_the_bench_runs_end_to_end_on_the_cpu(checkpoint, capsys):
    from mmpipe.app.bench.main import build_parser

    args = build_parser().parse_args(["serve", "--model", checkpoint, "--device", "cpu", "--rates", "inf",
                                      "--concurrency", "1,2", "--requests", "3", "--saturation-requests", "5",
                                      "--output-tokens", "3", "--input-tokens", "16", "--image-size", "56x56"])
    result = bench_serve.run_serve(args)
    assert [(p["prompts"], p["concurrency"], p["completed"]) for p in result["points"]] == [
        ("text", 1, 3), ("text", 2, 5), ("image", 1, 3), ("image", 2, 5)]  # the saturation point's own count
    assert all(p["output_tokens"] == 3 * p["completed"] for p in result["points"])
    assert [(c["prompts"], c["concurrency"], c["saturation"]) for c in result["comparison"]] == [
        ("text", 1, False), ("text", 2, True), ("image", 1, False), ("image", 2, True)]
    assert [c["api"]["completed"] for c in result["comparison"]] == [3, 5, 3, 5]
    assert all(c["server"] is not None and c["ttft_p50_ms"]["diff"] is not None for c in result["comparison"])
    printed = capsys.readouterr().out
    assert "mmpipe serve under load" in printed and "Server vs Python API" in printed


def test_several_load_processes_share_the_requests_and_the_cap(tpipe):
    """Three processes, a cap of 4: at most 4 in flight over all of them, every request once, the
    records in request order, times on one clock (none sent before it arrives)."""
    bodies = [chat_body(bench_serve.MODEL_NAME, [{"role": "user", "content": "word " * (i + 1)}], TOKENS)
              for i in range(9)]  # prompts of growing length: the records' order shows in their prompt tokens
    offsets = arrival_offsets(9, 60.0, seed=4)
    with bench_serve.serving(tpipe, 256) as url, LoadProcess(url, client="raw", processes=3) as load:
        run = load.run(bodies, offsets, 4)
        alone = load.run(bodies[:2], [0.0, 0.0], 1)  # a cap of 1 uses one process: one after the other
    assert [r.error for r in run.records] == [None] * 9 and [r.tokens for r in run.records] == [TOKENS] * 9
    prompt_tokens = [r.prompt_tokens for r in run.records]
    assert prompt_tokens == sorted(set(prompt_tokens))  # every request once, in request order
    assert all(r.sent >= offset - 1e-3 for r, offset in zip(run.records, offsets))
    assert _most_in_flight(run.records) <= 4
    assert run.wall_s == max(r.end for r in run.records) and 0 < run.cpu_s
    assert alone.records[1].sent >= alone.records[0].end


def test_graph_captures_count_what_a_run_captured_over_every_runner():
    before = {"vit": {"captures": 2, "capture_seconds": 1.0}, "prefill": {"captures": 5, "capture_seconds": 2.0},
              "decode": {"captures": 7, "capture_seconds": 0.5}, "kv_pages": {}}
    after = {"vit": {"captures": 3, "capture_seconds": 1.25}, "prefill": {"captures": 5, "capture_seconds": 2.0},
             "decode": {"captures": 9, "capture_seconds": 0.75}, "kv_pages": {}}
    assert bench_serve.graph_captures(before, after) == {"graph_captures": 3, "capture_s": pytest.approx(0.5)}
    assert bench_serve.graph_captures(after, after) == {"graph_captures": 0, "capture_s": 0.0}


def test_the_bench_parser_needs_no_video_decoder():
    """`mmpipe bench serve` on a machine without PyAV: only the video bench may need it, when it
    writes its clips."""
    code = ("import sys; sys.modules['av'] = None\n"
            "from mmpipe.app.bench.main import build_parser\n"
            "print(build_parser().parse_args(['serve', '--requests', '3']).requests)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_clearing_the_caches_leaves_a_run_nothing_an_earlier_run_prepared(tpipe):
    """The server's run goes first: the API's run must not find its prompts tokenized, its
    images decoded or its KV pages cached."""
    conversation = [{"role": "user", "content": "A prompt that both runs send, word for word. " * 8}]
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    tpipe.chat([conversation], params)
    rendered = tpipe.processor.render_chat(conversation, "test")[0]
    kept = tpipe.processor._kept_ids
    assert kept.cache_info().currsize > 0
    hits = kept.cache_info().hits
    tpipe.processor.token_ids(rendered)
    assert kept.cache_info().hits == hits + 1  # kept: the next run would not tokenize it
    assert tpipe.stats()["prefix_cache"]["cached_pages"] > 0
    bench_serve.clear_caches(tpipe)
    assert kept.cache_info().currsize == 0
    assert tpipe.stats()["prefix_cache"]["cached_pages"] == 0
