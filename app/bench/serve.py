"""`mmpipe bench serve`: `mmpipe serve` under load, and what the HTTP layer costs next to the
Python API on the same requests (issue 59).

How it runs. As `mmpipe serve` runs: the Pipeline in an engine process (`EngineProcess`) and
the real server, `create_app(engine)` under uvicorn on loopback, in this process (on a thread of
its own, writing no access log). The load comes from `--load-processes` processes of its own
(spawned, `serve_load.LoadProcess`), each an asyncio loop sending streaming chat completions; in
the server's process their work would count as the server's. The Python API's side runs in the
engine's process (`EngineProcess.call`), on the very same Pipeline: only the way in differs.

What it measures. For each kind of prompt (`--prompts`: text of about `--input-tokens` tokens,
or one `--image-size` JPEG of noise, a new one for every request, sent as a data URI, plus a
question) and each point of the grid `--rates` x `--concurrency`: `--requests` requests (at the
saturation point, `--saturation-requests`: a few waves of the batch would time its ramp) arrive
as a Poisson process of that rate (all at once for inf) and are sent while fewer than the cap
are in flight; each decodes exactly `--output-tokens` tokens (greedy, `ignore_eos`). Per request:
TTFT, TPOT, every gap between chunks that carry text (ITL) and end-to-end latency; per point:
request and output token throughput; mean, p50, p90 and p99 (`serve_load.summarise`). Every run
starts with empty caches (`clear_caches`). Each kind first runs one untimed batch both ways in.

The overhead comparison. At rate inf with concurrency 1 and with the largest cap (saturation:
the batch), the same requests also run through `Pipeline.stream`, one thread each, as the server
runs a choice (`serve_load.drive_api`), right after the server's run. The issue's target: the
server's TTFT within TTFT_TARGET_MS or TTFT_TARGET_SHARE of the Python API's (p50), and its output
throughput within THROUGHPUT_TARGET_SHARE of the API's at saturation.

The checkpoint. `--model DIR` serves any checkpoint. Without it, the `--shape` random checkpoint
is built, except that the output rows of tokens that do not decode to text on their own are zero,
so greedy decoding picks text tokens. The synthetic tokenizer knows only a few hundred of the
model's ids; the others decode to nothing, and a stream of them would have no chunks to time. The
shapes and the work are those of `shapes.build_checkpoint`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from mmpipe.app.arg_types import positive
from mmpipe.app.bench.results import table
from mmpipe.app.bench.serve_load import LoadProcess, Run, arrival_offsets, chat_body, drive_api, summarise
from mmpipe.app.bench.shapes import SHAPES, add_shape_argument, default_checkpoint_dir, hf_config

TTFT_TARGET_MS = 2.0  # the server's TTFT may exceed the API's by this many milliseconds ...
TTFT_TARGET_SHARE = 0.10  # ... or by this share of it
THROUGHPUT_TARGET_SHARE = 0.05  # its output throughput may fall short of the API's by this share at saturation
MODEL_NAME = "bench"
IMAGE_QUESTION = "Describe this image."
KINDS = ("text", "image")


# ------------------------------------------------------------------ arguments


def _items(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give at least one value")
    return items


def rates_arg(value: str) -> list[float]:
    """'1,4,16,inf' -> request rates (requests per second; inf: all at once)."""
    rates = []
    for item in _items(value):
        try:
            rate = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a rate") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"a rate must be above 0, got {item}")
        rates.append(rate)
    return rates


def caps_arg(value: str) -> list[int | None]:
    """'1,8,32' -> concurrency caps ('inf': none)."""
    caps: list[int | None] = []
    for item in _items(value):
        if item == "inf":
            caps.append(None)
            continue
        try:
            caps.append(positive(item))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"concurrency {item!r}: {exc}") from None
    return caps


def kinds_arg(value: str) -> list[str]:
    kinds = _items(value)
    if unknown := [k for k in kinds if k not in KINDS]:
        raise argparse.ArgumentTypeError(f"prompts are {' or '.join(KINDS)}, got {', '.join(unknown)}")
    return list(dict.fromkeys(kinds))


def size_arg(value: str) -> tuple[int, int]:
    """'448x448' (or '448') -> (width, height)."""
    parts = value.lower().split("x")
    try:
        width, height = (positive(parts[0]), positive(parts[-1])) if len(parts) <= 2 else (0, 0)
    except argparse.ArgumentTypeError:
        width = height = 0
    if not width:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size (WIDTHxHEIGHT, e.g. 448x448)")
    return width, height


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_argument(parser)
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--model", default=None, help="serve this checkpoint instead of a random one")
    parser.add_argument("--rates", type=rates_arg, default="1,4,16,inf",
                        help="request rates, requests per second (Poisson arrivals; inf: all at once; default %(default)s)")
    parser.add_argument("--concurrency", type=caps_arg, default="1,8,32",
                        help="caps on the requests in flight ('inf': no cap; default %(default)s); the largest is "
                             "the saturation point of the server vs Python API comparison")
    parser.add_argument("--prompts", type=kinds_arg, default="text,image", help="kinds of prompt: text, image (default %(default)s)")
    parser.add_argument("--requests", type=positive, default=64, help="requests per point (default %(default)s)")
    parser.add_argument("--saturation-requests", type=positive, default=None,
                        help="requests at rate inf and the largest cap (default: 16 times that cap)")
    parser.add_argument("--output-tokens", type=positive, default=128, help="tokens every request decodes (default %(default)s)")
    parser.add_argument("--input-tokens", type=positive, default=256, help="about this many tokens per text prompt (default %(default)s)")
    parser.add_argument("--image-size", type=size_arg, default="448x448", help="WIDTHxHEIGHT of the images (default %(default)s)")
    parser.add_argument("--batch-size", type=positive, default=None,
                        help="the engine's max_running_requests (default: its own)")
    parser.add_argument("--device", default=None, help="default: the best available")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts, images and arrivals")
    parser.add_argument("--load-processes", type=positive, default=4,
                        help="processes sending the load, sharing the requests and the concurrency cap (default "
                             "%(default)s): one process reading many fast streams falls behind them")
    parser.add_argument("--client", choices=("openai", "raw"), default="openai",
                        help="the load generator's client: the openai SDK, or bare HTTP (each request's bytes "
                             "encoded before the run, written on a kept-alive socket), which leaves the client's "
                             "own work per request out of the server's figures (default %(default)s)")


# ------------------------------------------------------------------ checkpoint and requests


def text_token_ids(tokenizer: Any) -> list[int]:
    """The ids that decode, alone, to text: not special, not empty, no partial character."""
    special = set(tokenizer.all_special_ids)
    ids = []
    for i in range(len(tokenizer)):
        text = "" if i in special else tokenizer.decode([i], skip_special_tokens=True)
        if text and "\ufffd" not in text:
            ids.append(i)
    return ids


def keep_rows(weight: torch.Tensor, ids: list[int]) -> None:
    """Zero every row of `weight` but those of `ids` (an output head: only they can win argmax)."""
    keep = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    keep[ids] = True
    with torch.no_grad():
        weight[~keep] = 0


def write_text_checkpoint(path: str, config: Any, tokenizer: Any, device: str = "cpu", **pixels: Any) -> str:
    """A random bfloat16 checkpoint of `config` whose output head keeps only text tokens' rows."""
    from mmpipe.app.tiny.synthetic import model_class, write_checkpoint

    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)._from_config(config, dtype=torch.bfloat16)
    keep_rows(model.get_output_embeddings().weight, text_token_ids(tokenizer))
    write_checkpoint(path, model, tokenizer, **pixels)
    return path


def build_text_checkpoint(path: str | None, shape: str) -> str:
    """The `shape` checkpoint of `shapes.build_checkpoint` with text-only output rows, kept in
    `path` (default: beside the plain one) and reused."""
    from mmpipe.app.tiny.synthetic import build_tokenizer

    path = path or default_checkpoint_dir(shape) + "-text"
    if not os.path.isfile(os.path.join(path, "config.json")):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        write_text_checkpoint(path, hf_config(shape), build_tokenizer(vocab_size=512), device,
                              min_pixels=56 * 56, max_pixels=SHAPES[shape].max_pixels)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return path


def text_prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[str]:
    """`count` different texts of `length` random text tokens each (about as many when encoded again)."""
    pool, rng = text_token_ids(tokenizer), random.Random(seed)
    return [tokenizer.decode([rng.choice(pool) for _ in range(length)]) for _ in range(count)]


def image_uris(count: int, width: int, height: int, seed: int) -> list[str]:
    """`count` different noise-and-gradient JPEGs as data URIs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width, dtype=np.float32)
    uris = []
    for i in range(count):
        pixels = (rng.integers(0, 96, (height, width, 3)) + ramp[None, :, None] * 0.6 + i) % 256
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, "JPEG", quality=90)
        uris.append("data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode())
    return uris


def make_bodies(kind: str, tokenizer: Any, count: int, input_tokens: int, output_tokens: int,
                image_size: tuple[int, int], seed: int) -> list[dict[str, Any]]:
    """`count` request bodies of one kind (every prompt different)."""
    if kind == "text":
        messages = [[{"role": "user", "content": text}]
                    for text in text_prompts(tokenizer, count, input_tokens, seed)]
    else:
        messages = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                  {"type": "text", "text": IMAGE_QUESTION}]}]
                    for uri in image_uris(count, *image_size, seed)]
    return [chat_body(MODEL_NAME, m, output_tokens) for m in messages]


def api_job(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The conversation and sampling the server runs for `body` (its own parser), for `Pipeline.stream`."""
    from mmpipe.app.serve_protocol import parse_chat

    job = parse_chat(body, (MODEL_NAME,), None)
    return job.conversation, job.sampling[0]


# ------------------------------------------------------------------ server and runs


@contextlib.contextmanager
def serving(engine: Any, max_queued: int) -> Iterator[str]:
    """`create_app(engine)` on a free loopback port, on a thread; yields the API's base URL."""
    from mmpipe.app.serve import on_loopback
    from mmpipe.app.serve_api import create_app

    with on_loopback(create_app(engine, served_model_name=MODEL_NAME, max_queued=max_queued)) as url:
        yield url + "/v1"


# What the benchmark runs in the engine's process (`EngineProcess.call`: function(pipe, *args)).


def clear_caches(pipe: Any) -> None:
    """Forget tokenized prompts, decoded and encoded images, cached KV pages: each run does its own."""
    with pipe.engine.lock:
        pipe.engine.cache.clear()
        pipe.engine.reset_prefix_cache()
        pipe.processor.preprocessed.clear()
        pipe.processor.forget_prompts()


def warm_up_images(pipe: Any, image: str) -> None:
    pipe.warm_up(images=[image])


def device_name(pipe: Any) -> str:
    return torch.cuda.get_device_name(pipe.device) if pipe.device.type == "cuda" else str(pipe.device)


GRAPH_RUNNERS = ("vit", "prefill", "decode")


def graph_captures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The CUDA graphs a run captured (all runners) and the seconds that took, from
    `Pipeline.stats()` before and after it: a run that meets a new shape pays its capture, and the
    run after it does not."""
    def total(stats: dict[str, Any], key: str) -> float:
        return sum(stats.get(runner, {}).get(key, 0) for runner in GRAPH_RUNNERS)

    return {"graph_captures": int(total(after, "captures") - total(before, "captures")),
            "capture_s": total(after, "capture_seconds") - total(before, "capture_seconds")}


def label(rate: float, cap: int | None) -> dict[str, Any]:
    return {"rate": "inf" if math.isinf(rate) else rate, "concurrency": "inf" if cap is None else cap}


def overhead(api: dict[str, Any], server: dict[str, Any], saturation: bool) -> dict[str, Any]:
    """The server's TTFT (p50, mean) and throughputs against the API's: differences, and whether
    they meet the issue's target (throughput: at saturation only)."""
    def diff(a: float | None, s: float | None) -> dict[str, float | None]:
        ok = a is not None and s is not None
        return {"api": a, "server": s, "diff": s - a if ok else None,
                "diff_pct": 100 * (s - a) / a if ok and a else None}

    ttft = diff(api["ttft_ms"]["p50"], server["ttft_ms"]["p50"])
    tput = diff(api["output_throughput"], server["output_throughput"])
    ttft_ok = ttft["diff"] is not None and (ttft["diff"] <= TTFT_TARGET_MS or (
        ttft["diff_pct"] is not None and ttft["diff_pct"] <= 100 * TTFT_TARGET_SHARE))
    tput_ok = tput["diff_pct"] is not None and tput["diff_pct"] >= -100 * THROUGHPUT_TARGET_SHARE
    return {"saturation": saturation, "ttft_p50_ms": ttft,
            "ttft_mean_ms": diff(api["ttft_ms"]["mean"], server["ttft_ms"]["mean"]), "output_throughput": tput,
            "request_throughput": diff(api["request_throughput"], server["request_throughput"]),
            "ttft_within_target": ttft_ok, "throughput_within_target": tput_ok if saturation else None}


def saturation_batch(caps: list[int | None], requests: int) -> int:
    return max((c for c in caps if c is not None), default=None) or requests


def sweep(engine: Any, load: LoadProcess, bodies: dict[str, list[dict[str, Any]]], rates: list[float],
          caps: list[int | None], seed: int, requests: int, saturation_requests: int) -> dict[str, Any]:
    """Every grid point through the server; at rate inf, concurrency 1 and the batch, the API too."""
    batch = saturation_batch(caps, requests)
    points, comparison = [], []

    def measured(drive: Callable[..., Run], *how: Any) -> dict[str, Any]:
        engine.call(f"{__name__}:clear_caches")
        before = engine.stats()
        point = summarise(drive(*how))
        return {**point, **graph_captures(before, engine.stats())}

    def through_api(*how: Any) -> Run:  # `drive_api` beside the Pipeline, in the engine's process
        return engine.call(f"{drive_api.__module__}:drive_api", *how)

    for kind, kind_bodies in bodies.items():
        jobs = [api_job(b) for b in kind_bodies]
        warm = min(batch, len(kind_bodies))  # untimed: connections, Triton, allocator, ViT packs
        load.run(kind_bodies[:warm], [0.0] * warm, warm)
        through_api(jobs[:warm], [0.0] * warm, warm)
        grid = [(rate, cap) for rate in rates for cap in caps]
        compared = sorted({1, batch})
        extra = [(math.inf, cap) for cap in compared if (math.inf, cap) not in grid]
        for rate, cap in grid + extra:
            count = saturation_requests if math.isinf(rate) and cap == batch else requests
            offsets = arrival_offsets(count, rate, seed)
            server = measured(load.run, kind_bodies[:count], offsets, cap)
            where = {"prompts": kind, **label(rate, cap)}
            if (rate, cap) in grid:
                points.append({**where, **server})
                _progress(where, server)
            if math.isinf(rate) and cap in compared:
                api = measured(through_api, jobs[:count], offsets, cap)
                comparison.append({**where, "server": server, "api": api, **overhead(api, server, cap == batch)})
                _progress({**where, "via": "Python API"}, api)
    return {"batch": batch, "points": points, "comparison": comparison}


def _progress(where: dict[str, Any], point: dict[str, Any]) -> None:
    words = " ".join(f"{k} {v}" for k, v in where.items())
    print(f"  {words}: {_num(point['output_throughput'], 1)} tok/s, TTFT p50 {_num(point['ttft_ms']['p50'])} ms, "
          f"{point['errors']} errors", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import uvicorn  # noqa: F401
        from mmpipe.app.serve_api import create_app  # noqa: F401

        if args.client == "openai":
            import openai  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"mmpipe bench serve: {exc.name} is not installed; run  pip install 'mmpipe[serve]' openai")
    from mmpipe.app.serve_engine import EngineProcess

    path = args.model or build_text_checkpoint(args.checkpoint, args.shape)
    sampling = api_job(chat_body(MODEL_NAME, [{"role": "user", "content": "-"}], args.output_tokens))[1]
    options: dict[str, Any] = {"device": args.device, "startup_progress": False}
    if args.batch_size:
        options["max_running_requests"] = args.batch_size
    engine = EngineProcess(path, startup_sampling=sampling, **options)  # as `mmpipe serve` runs it
    saturated = args.saturation_requests or 16 * saturation_batch(args.concurrency, args.requests)
    try:
        most = max(args.requests, saturated)
        bodies = {kind: make_bodies(kind, engine.tokenizer, most, args.input_tokens, args.output_tokens,
                                    args.image_size, args.seed) for kind in args.prompts}
        with serving(engine, max(256, most)) as url, \
                LoadProcess(url, client=args.client, processes=args.load_processes) as load:
            device = engine.call(f"{__name__}:device_name")
            if "image" in bodies:  # the ViT graphs for packs of these images, before anything is timed
                engine.call(f"{__name__}:warm_up_images", bodies["image"][0]["messages"][0]["content"][0]["image_url"]["url"])
            result = sweep(engine, load, bodies, args.rates, args.concurrency, args.seed, args.requests, saturated)
    finally:
        engine.close()
    width, height = args.image_size
    result.update(device=device, model=path if args.model else f"{SHAPES[args.shape].label} shape, random",
                  requests=args.requests, saturation_requests=saturated, output_tokens=args.output_tokens, input_tokens=args.input_tokens,
                  client=args.client,
                  image_size=f"{width}x{height}")
    print(report(result))
    return result


# ------------------------------------------------------------------ report


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(result: dict[str, Any]) -> str:
    """The grid's table, the comparison's table and notes on anything that makes figures doubtful."""
    rows = []
    for p in result["points"]:
        t, o, i, e = p["ttft_ms"], p["tpot_ms"], p["itl_ms"], p["e2e_ms"]
        rows.append([p["prompts"], p["rate"], p["concurrency"], _num(p["request_throughput"]),
                     _num(p["output_throughput"], 1), _num(t["mean"]), _num(t["p50"]), _num(t["p90"]), _num(t["p99"]),
                     _num(o["p50"]), _num(o["p90"]), _num(o["p99"]), _num(i["p50"]), _num(i["p90"]), _num(i["p99"]),
                     _num(e["p50"], 1), _num(e["p99"], 1), _num(p["tokens_per_chunk"]), _num(p["client_cpu_share"]), p.get("graph_captures", "-")])
    out = (f"{result['model']} on {result['device']}; {result['requests']} requests a point "
           f"({result['saturation_requests']} at saturation), "
           f"{result['output_tokens']} new tokens each (ignore_eos), text prompts of about {result['input_tokens']} "
           f"tokens, {result['image_size']} JPEGs as data URIs; client: "
           f"{'bare HTTP' if result.get('client') == 'raw' else 'the openai SDK'}\n\n")
    out += table("mmpipe serve under load: throughput (requests/s, output tokens/s) and latency (ms)",
                 ["prompts", "rate", "concurrency", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p90",
                  "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99", "ITL p50", "ITL p90", "ITL p99", "E2E p50", "E2E p99",
                  "tokens/chunk", "client CPU", "graph captures"], rows)
    rows = []
    for c in result["comparison"]:
        t, m, o = c["ttft_p50_ms"], c["ttft_mean_ms"], c["output_throughput"]
        verdict = " / ".join("yes" if ok else "no" for ok in (c["ttft_within_target"], c["throughput_within_target"])
                             if ok is not None)
        rows.append([c["prompts"], c["concurrency"], _num(t["api"]), _num(t["server"]), _num(t["diff"]),
                     _num(t["diff_pct"], 1), _num(m["api"]), _num(m["server"]), _num(o["api"], 1), _num(o["server"], 1),
                     _num(o["diff_pct"], 1), verdict])
    out += "\n" + table(f"Server vs Python API, rate inf (saturation: concurrency {result['batch']}); TTFT in ms",
                        ["prompts", "concurrency", "TTFT p50 API", "server", "diff", "diff %", "TTFT mean API", "server",
                         "out tok/s API", "server", "diff %", "within target (TTFT / throughput)"], rows)
    return out + "".join(f"\nnote: {n}" for n in notes(result))


def notes(result: dict[str, Any]) -> list[str]:
    found = []
    everything = [p for p in result["points"]] + [c[s] for c in result["comparison"] for s in ("server", "api")]
    if bad := [p for p in everything if p["errors"]]:
        found.append(f"{len(bad)} runs had failed requests, e.g. {bad[0]['first_error']}")
    if short := [p for p in everything if p["output_tokens"] != p["completed"] * result["output_tokens"]]:
        found.append(f"{len(short)} runs had requests that ended before --output-tokens")
    if [p for p in everything if p["without_text"] or (p["tokens_per_chunk"] or 1) > 1.05]:
        found.append("some chunks carried several tokens (or none had text): ITL counts gaps between chunks")
    if busy := [p["client_cpu_share"] for p in everything if (p["client_cpu_share"] or 0) > 0.8]:
        found.append(f"the load generator was busy for up to {max(busy):.0%} of a run: it may have lagged the server")
    if paid := [c for c in result["comparison"] if c["server"].get("graph_captures") or c["api"].get("graph_captures")]:
        found.append("compared runs that captured CUDA graphs (first met a shape; the run after did not): " + ", ".join(
            f"{c['prompts']} at {c['concurrency']} (server {c['server']['graph_captures']} in "
            f"{c['server']['capture_s']:.2f} s, API {c['api']['graph_captures']})" for c in paid))
    return found
