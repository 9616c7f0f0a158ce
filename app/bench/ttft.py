"""`mmpipe bench ttft`: an image request's time to first token as its caller sees it, next to the
GPU kernel time it needs and what `RequestOutput.metrics` reports.

One process, one Pipeline (graphs on), 3B shape or `--shape`. Rows: a 512x512 PNG file plus a
short prompt through `pipe.chat`, with the encoder cache cold (a different file every request: it
is decoded, resized, encoded by the ViT) and warm (the same file every request: its preprocessed
image comes from the preprocessed-image cache and its embeddings from the encoder cache), and a
text prompt of 256 tokens for reference.
Columns: the median wall time of `pipe.chat(..., max_new_tokens=1)` from the call to its return,
the median `metrics.time_to_first_token_s` and `metrics.preprocess_s` of the same requests, the
sum of the GPU kernel times of one such request (profiler), and wall / kernel time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
from mmpipe.app.bench.prefill import text_of_tokens
from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import add_shape_argument, build_checkpoint
from mmpipe.app.bench.timing import kernel_ms, median


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_argument(parser)
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--repeats", type=int, default=20, help="timed requests per row (median)")
    parser.add_argument("--size", type=int, default=512, help="the PNG's side in pixels")


def write_pngs(folder: str, count: int, size: int) -> list[str]:
    """`count` different noise-and-gradient PNG files (never constant: every pixel matters)."""
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    paths = []
    for i in range(count):
        noise = rng.integers(0, 96, (size, size, 3), dtype=np.int64)
        pixels = (noise + ramp[None, :, None] * 0.6 + i) % 256
        path = os.path.join(folder, f"image_{i:04d}.png")
        Image.fromarray(pixels.astype(np.uint8)).save(path)
        paths.append(path)
    return paths


def measure(pipe: Any, requests: Callable[[], Any], repeats: int) -> dict[str, float]:
    from mmpipe import SamplingParams

    one = SamplingParams(max_new_tokens=1, temperature=0)
    walls, ttfts, preps = [], [], []
    for i in range(repeats + 3):
        conversation = requests()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = pipe.chat([conversation], one)[0]
        wall = time.perf_counter() - start
        assert out.ok, out.error
        if i >= 3:  # the first ones warm up
            walls.append(wall * 1000)
            ttfts.append(out.metrics.time_to_first_token_s * 1000)
            preps.append(out.metrics.preprocess_s * 1000)
    kernel = kernel_ms(lambda: pipe.chat([requests()], one))
    wall = median(walls)
    return {"wall_ms": wall, "metrics_ttft_ms": median(ttfts), "preprocess_ms": median(preps),
            "kernel_ms": kernel, "wall_over_kernel": wall / kernel}


def run_ttft(args: argparse.Namespace) -> dict[str, Any]:
    from mmpipe import Pipeline

    ckpt = build_checkpoint(args.checkpoint, args.shape)
    folder = tempfile.mkdtemp(prefix="mmpipe-bench-ttft-")
    files = write_pngs(folder, 2 * args.repeats + 16, args.size)
    pipe = Pipeline.from_pretrained(ckpt, startup_progress=False)
    fresh: Iterator[str] = iter(files[1:])

    def image_chat(path: str) -> Any:
        return [{"role": "user", "content": [{"type": "image", "image": path},
                                             {"type": "text", "text": "Describe this image."}]}]

    text = text_of_tokens(ckpt, 256)
    rows_spec = [(f"{args.size} px PNG, encoder cache cold", lambda: image_chat(next(fresh))),
                 (f"{args.size} px PNG, encoder cache warm", lambda: image_chat(files[0])),
                 ("256-token text", lambda: [{"role": "user", "content": text}])]
    result: dict[str, Any] = {"rows": {}}
    rows = []
    for name, requests in rows_spec:
        r = measure(pipe, requests, args.repeats)
        result["rows"][name] = r
        rows.append([name, round(r["wall_ms"], 2), round(r["metrics_ttft_ms"], 2), round(r["preprocess_ms"], 2),
                     round(r["kernel_ms"], 2), round(r["wall_over_kernel"], 2)])
    pipe.close()
    print(table(f"Time to first token from the call, ms ({torch.cuda.get_device_name()})",
                ["request", "wall", "metrics TTFT", "metrics preprocess", "GPU kernels", "wall / kernels"], rows))
    return result
