"""`mmpipe bench caption`: captioning image files end to end, and where the time goes.

1. `transformers` `generate` in batches of `--hf-batch` against mmpipe's continuous stream
   (`Pipeline.chat_stream`, what `mmpipe caption` uses) with overlapped scheduling on and
   off, and with the ViT on its own CUDA stream and in line; same process, the same files
   (`--images`, e.g. 256 and 1024), file decoding included.
2. A timeline of one mmpipe run under torch.profiler (`--timeline PNG`): GPU busy fraction, GPU
   time in the ViT, prefill and decode, host-only gaps, host time per engine phase; one PNG for
   overlap on and one for off (the vision stream as configured).
3. Optionally `mmpipe caption --gpus N` as a user runs it (`--gpus 1,2`): data parallel, one
   process per GPU; throughput counts from the moment every process is captioning.

Qwen2.5-VL-3B-shaped random weights (or `--shape`, app/bench/shapes.py), 448x448 JPEG files, `--new-tokens` tokens
per image (min_new_tokens = max_new_tokens, greedy).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import SHAPES, add_shape_argument, build_checkpoint, load_options
from mmpipe.app.bench.throughput import hf_generate_batched
from mmpipe.app.bench.timing import timed
from PIL import Image


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", default="256,1024", help="comma-separated file counts")
    parser.add_argument("--hf-images", default=None, help="file counts for transformers (default: --images)")
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--timeline", default=None, help="write the profiled timeline here (PNG; needs matplotlib)")
    parser.add_argument("--timeline-images", type=int, default=256)
    parser.add_argument("--engine", default=None, help="EngineConfig overrides as JSON")
    parser.add_argument("--prefill-budgets", default="", help="also run the largest --images count with these "
                        "max_prefill_tokens (at most the engine's), lowered at run time")
    parser.add_argument("--quantizations", default="", help="also caption with these quantizations (comma-separated: "
                        "fp8, fp8-all), each in a Pipeline of its own, overlap on")
    parser.add_argument("--gpus", default="", help="comma-separated process counts for `mmpipe caption --gpus`")
    parser.add_argument("--cli-images", type=int, default=512, help="at least this many files in the folder that "
                        "--gpus captions (all of it)")
    add_shape_argument(parser)
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--workdir", default=None, help="where the JPEG files go (default: a temporary folder)")


def write_jpegs(folder: str, count: int, size: int = 448) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"img{i:05d}.jpg")
        if not os.path.exists(path):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path, quality=90)
        paths.append(path)
    return paths


def variant_name(overlap: bool, vision_stream: bool) -> str:
    return f"mmpipe chat_stream, overlap {'on' if overlap else 'off'}" + ("" if vision_stream else ", vision stream off")


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_caption(args: argparse.Namespace) -> dict[str, Any]:
    from mmpipe import Pipeline, SamplingParams
    from mmpipe.captioning import caption_conversation

    work = args.workdir or tempfile.mkdtemp(prefix="mmpipe-bench-caption-")
    ckpt = build_checkpoint(args.checkpoint, args.shape)
    label = SHAPES[args.shape].label
    sizes = _sizes(args.images)
    hf_sizes = _sizes(args.hf_images) if args.hf_images is not None else sizes
    paths = write_jpegs(os.path.join(work, "images"), max(sizes + hf_sizes + [args.cli_images if args.gpus else 0]))
    params = SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, temperature=0.0)
    prompt = "Describe this image."
    device = torch.cuda.get_device_name()
    seconds: dict[tuple[str, int], float] = {}

    if hf_sizes:
        from mmpipe.app.bench.shapes import hf_model

        model = hf_model(ckpt)
        with torch.inference_mode():
            hf_generate_batched(model, ckpt, paths[:4], prompt, 4, 4)  # warm-up
            for n in hf_sizes:
                seconds[(f"transformers generate, batches of {args.hf_batch}", n)] = hf_generate_batched(
                    model, ckpt, paths[:n], prompt, args.new_tokens, args.hf_batch)
        del model
        torch.cuda.empty_cache()

    summaries: dict[str, dict[str, float]] = {}
    top_kernels: dict[str, list[list[Any]]] = {}
    engine_options = {**load_options(ckpt), **json.loads(args.engine or "{}")}
    convs = [caption_conversation(p, prompt) for p in paths]

    def stream(pipe: Any, n: int, overlap: bool) -> float:
        engine = pipe.engine
        engine.drain()
        engine.overlap = overlap  # switchable between runs, with no step in flight
        engine.cache.clear()  # every run encodes and prefills its images, as a run over new files does
        engine.reset_prefix_cache()
        done, seconds = timed(lambda: sum(1 for _ in pipe.chat_stream(iter(convs[:n]), params)))
        assert done == n
        return seconds

    with Pipeline.from_pretrained(ckpt, device="cuda", dtype="bfloat16", **engine_options) as pipe:
        engine = pipe.engine
        configured = engine.overlap, pipe.runner.vision_stream is not None
        stream(pipe, 64, True)  # warm-up: Triton JIT, cuBLAS, ViT graphs, allocator
        stream(pipe, 64, False)
        base_cfg = engine.scheduler.cfg
        for budget in _sizes(args.prefill_budgets):
            # Lowered at run time on the same Pipeline (graphs and buffers are sized for the
            # larger default, so a smaller budget is safe): what each budget gives, measured.
            engine.scheduler.cfg = dataclasses.replace(base_cfg, max_prefill_tokens=min(budget, base_cfg.max_prefill_tokens))
            n = max(sizes)
            seconds[(f"mmpipe chat_stream, overlap on, max_prefill_tokens {budget}", n)] = stream(pipe, n, True)
        engine.scheduler.cfg = base_cfg
        for n in sizes:
            for _ in range(2):  # best of two, alternating
                for overlap in (True, False):
                    name = variant_name(overlap, configured[1])
                    seconds[(name, n)] = min(stream(pipe, n, overlap), seconds.get((name, n), float("inf")))
        if args.timeline:
            for overlap in (True, False):
                key = "on" if overlap else "off"
                summaries[key], top_kernels[key] = profile_run(
                    pipe, convs[:args.timeline_images], params, overlap, _timeline_path(args.timeline, overlap),
                    f"mmpipe captioning {args.timeline_images} JPEG files ({label} shape, bf16, {args.new_tokens} tokens), "
                    f"overlap {'on' if overlap else 'off'}, {device}")
        engine.drain()
        engine.overlap = configured[0]  # the statistics report the configuration, not the last run
        stats = pipe.stats()
    del engine, pipe  # the next Pipeline needs the weights' memory (a 30B shape fits only once)
    gc.collect()
    torch.cuda.empty_cache()
    if configured[1]:  # the ViT in line: a Pipeline of its own (the stream is fixed for a Pipeline's life)
        with Pipeline.from_pretrained(ckpt, device="cuda", dtype="bfloat16",
                                      **{**engine_options, "vision_stream": False}) as inline:
            stream(inline, 64, True)  # warm-up
            for n in sizes:
                name = variant_name(True, False)
                seconds[(name, n)] = min(stream(inline, n, True) for _ in range(2))
        del inline
        gc.collect()
        torch.cuda.empty_cache()

    for quantization in [q for q in args.quantizations.split(",") if q]:
        with Pipeline.from_pretrained(ckpt, device="cuda", dtype="bfloat16",
                                      **{**engine_options, "quantization": quantization}) as quantized:
            stream(quantized, 64, True)  # warm-up
            for n in sizes:
                seconds[(f"mmpipe chat_stream, overlap on, {quantization}", n)] = min(
                    stream(quantized, n, True) for _ in range(2))
            if args.timeline:
                stem, ext = os.path.splitext(args.timeline)
                summaries[f"on, {quantization}"], top_kernels[f"on, {quantization}"] = profile_run(
                    quantized, convs[:args.timeline_images], params, True, f"{stem}_{quantization}{ext or '.png'}",
                    f"mmpipe captioning {args.timeline_images} JPEG files ({label} shape, {quantization}, "
                    f"{args.new_tokens} tokens), overlap on, {device}")

    rows = []
    for n in sorted(set(sizes) | set(hf_sizes)):
        base = seconds.get((f"transformers generate, batches of {args.hf_batch}", n))
        for (name, count), sec in seconds.items():
            if count == n:
                rows.append([name, n, round(sec, 2), round(n / sec, 1), round(n * args.new_tokens / sec),
                             f"{base / sec:.1f}x" if base else "-"])
    print(f"448x448 JPEG files, {args.new_tokens} new tokens each, {label}-shaped random weights, bfloat16, "
          f"{device}; file decoding included\n")
    print(table("Captioning files, same process", ["system", "files", "seconds", "images/s", "generated tok/s",
                                                     "vs transformers"], rows))
    if summaries:
        keys = ["seconds", "gpu_busy", "gpu_vision", "gpu_prefill", "gpu_decode", "gpu_other", "host_only_gaps",
                "idle_start_s", "idle_middle_s", "idle_tail_s", "host_schedule_s", "host_vision_s", "host_prefill_s", "host_decode_s", "host_read_s", "host_wait_s"]
        print(table(f"Timeline of one profiled run ({args.timeline_images} files; fractions of wall time, host "
                    "seconds per engine phase)", ["overlap"] + keys,
                    [[k] + [round(v[key], 3) for key in keys] for k, v in summaries.items()]))
        for key, kernels in top_kernels.items():
            if key.startswith("on"):
                print(table(f"Heaviest kernels of each phase, overlap {key} (GPU ms and calls per image)",
                            ["phase", "kernel", "ms per image", "calls per image"], kernels))
    result: dict[str, Any] = {"device": device, "new_tokens": args.new_tokens, "rows": rows, "timeline": summaries,
                              "top_kernels": top_kernels,
                              "engine": {k: stats[k] for k in ("graph_mode", "runner", "overlap_schedule",
                                                               "vision_stream", "encoder_cache")}}
    print("engine:", json.dumps(result["engine"]))
    cli_rows = []
    for count in [int(g) for g in args.gpus.split(",") if g]:
        out = os.path.join(work, f"captions-{count}gpu.jsonl")
        if os.path.exists(out):
            os.remove(out)
        command = [sys.executable, "-m", "mmpipe.cli", "caption", os.path.join(work, "images"), "--model", ckpt,
                   "--output", out, "--max-new-tokens", str(args.new_tokens), "--min-new-tokens",
                   str(args.new_tokens), "--dtype", "bfloat16", "--gpus", str(count)]
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        # Random weights often decode to an empty caption, which mmpipe caption reports as failed:
        # those images were still fully processed, so they count for throughput.
        shares = [(int(n) + int(f), float(s)) for n, s, f in re.findall(
            r"captioned (\d+) image\(s\) in ([\d.]+) s.*?(\d+) failed", proc.stderr)]
        if proc.returncode not in (0, 1) or len(shares) != count:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise RuntimeError(f"mmpipe caption --gpus {count} failed")
        images = sum(n for n, _ in shares)
        slowest = max(s for _, s in shares)
        lines = sum(1 for _ in open(out))
        cli_rows.append([count, images, lines, round(slowest, 2), round(images / slowest, 1), round(wall, 1)])
    if cli_rows:
        print(table(f"mmpipe caption --gpus N, the folder of {len(paths)} files", [
            "GPUs", "images processed", "captions written", "captioning s (slowest process)", "images/s", "wall s (with start-up)"],
            cli_rows))
    result["cli_rows"] = cli_rows
    return result


def _timeline_path(path: str, overlap: bool) -> str:
    stem, ext = os.path.splitext(path)
    return path if overlap else f"{stem}_no_overlap{ext or '.png'}"


def profile_run(pipe: Any, convs: list[Any], params: Any, overlap: bool, png: str, title: str
                ) -> tuple[dict[str, float], list[list[Any]]]:
    """One captioning run under torch.profiler; writes the timeline PNG, returns its summary and
    the heaviest kernels of each phase (GPU ms per image)."""
    from mmpipe.app.bench import timeline
    from torch.profiler import ProfilerActivity, profile, record_function

    pipe.engine.drain()
    pipe.engine.overlap = overlap
    pipe.engine.cache.clear()
    pipe.engine.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mmpipe.run"):
            for _ in pipe.chat_stream(iter(convs), params):
                pass
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        run = timeline.from_trace_events(timeline.load_trace(trace))
    summary = run.summary()
    summary["images_per_s_profiled"] = len(convs) / run.seconds
    kernels = [[name, kernel[:80], round(seconds * 1000 / len(convs), 3), round(calls / len(convs), 2)]
               for name in timeline.GPU_PHASES for kernel, seconds, calls in run.top_kernels(name)]
    try:
        timeline.plot(run, png, title)
        print(f"timeline written to {png}")
    except ImportError:
        print("matplotlib is not installed: no timeline PNG", file=sys.stderr)
    return summary, kernels
