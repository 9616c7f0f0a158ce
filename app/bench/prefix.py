"""`mmpipe bench prefix`: what prefix caching saves, and that captioning does not pay for it.

Three measurements on one Pipeline (random `--shape` checkpoint), the cache switched on and off
between runs (`Scheduler.prefix_caching`); the encoder cache stays on, as by default, so "off"
re-encodes no image either and the difference is the language model's prefill alone.

- A conversation's turn 4: two `--image-size` images in turns 1 and 2, assistant replies of
  filler text, about `--history-tokens` tokens before turn 4's question. Before each timed turn
  the history runs as a conversation would have left it (each turn's prompt and its reply,
  prefilled, untimed); then turn 4's time to first token (one new token) is timed.
- An identical request: turn 4's prompt again, right after itself; and, for scale, turn 4's
  prompt with both caches empty (its images encoded as well).
- Captioning `--caption-files` new JPEG files (a new image in every request: nothing to reuse),
  `--new-tokens` each, images/s, both caches cleared before every run; runs alternate on and off
  and the best of `--repeats` counts.

Times to first token are medians of `--repeats` runs, the device synchronized around each.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from typing import Any

import numpy as np
import torch
from mmpipe.app.bench.caption import write_jpegs
from mmpipe.app.bench.results import table
from mmpipe.app.bench.serve import size_arg
from mmpipe.app.bench.shapes import SHAPES, add_shape_argument, build_checkpoint
from mmpipe.app.bench.timing import timed
from PIL import Image

from mmpipe.errors import InputError

QUESTIONS = ["Describe the first picture.", "And this one?", "Compare the two pictures.",
             "Which one would you choose, and why?"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_argument(parser)
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--model", default=None, help="this checkpoint instead of a random one")
    parser.add_argument("--device", default="cuda", help="default: %(default)s")
    parser.add_argument("--image-size", type=size_arg, default="448x448", help="WIDTHxHEIGHT (default %(default)s)")
    parser.add_argument("--history-tokens", type=int, default=1500,
                        help="about this many prompt tokens before turn 4's question (default %(default)s)")
    parser.add_argument("--caption-files", type=int, default=1024, help="files captioned per run (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per caption (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default %(default)s)")
    parser.add_argument("--workdir", default=None, help="where the JPEG files go (default: a temporary folder)")


def conversation(images: list[Any], filler: str, turns: int) -> list[dict[str, Any]]:
    """The first `turns` user turns, each but the last answered with `filler`."""
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        content: list[dict[str, Any]] = [{"type": "image", "image": images[turn]}] if turn < len(images) else []
        messages.append({"role": "user", "content": content + [{"type": "text", "text": QUESTIONS[turn]}]})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": filler})
    return messages


def history_filler(pipe: Any, images: list[Any], target: int) -> str:
    """Filler replies sized so turn 4's prompt has about `target` tokens before its question."""
    words = ["the", "picture", "shows", "a", "quiet", "street", "with", "trees", "and", "a", "red", "door", "under", "a", "pale", "sky"]

    def tokens(count: int) -> float:
        text = " ".join(words[i % len(words)] for i in range(count))
        try:
            request = pipe.processor.build(0, *pipe.processor.render_chat(conversation(images, text, 4), "bench"),
                                           _one_token(), "bench")
        except InputError:  # past max_model_len: too many words
            return math.inf
        return request.prompt_len

    low, high = 1, target  # every word is a token at least, and the filler comes thrice
    while low < high:  # the fewest words reaching the target
        middle = (low + high) // 2
        low, high = (middle + 1, high) if tokens(middle) < target else (low, middle)
    return " ".join(words[i % len(words)] for i in range(low))


def _one_token() -> Any:
    from mmpipe import SamplingParams

    return SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)


class Prompts:
    """Prompts prepared once (template, tokens, images decoded and resized); each run assembles
    fresh requests from them and steps the engine until they have their first token."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def prepare(self, messages: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
        processor = self.pipe.processor
        prepared = processor.prepare(0, *processor.render_chat(messages, "bench"), _one_token(), "bench")
        return prepared, [processor.load_image(s, "bench") for s in prepared.image_sources]

    def first_token(self, prompt: tuple[Any, list[Any]]) -> tuple[float, int]:
        """Seconds to the first token, and the prompt tokens found cached."""
        engine = self.pipe.engine
        request = self.pipe.processor.assemble(*prompt)

        def run() -> None:
            with engine.lock:
                engine.add(request)
                while not request.finished:
                    engine.step()

        seconds = timed(run, self.pipe.device)[1]
        if request.error or len(request.output_ids) != 1:
            raise RuntimeError(f"mmpipe: no first token ({request.error})")
        return seconds, request.num_cached_tokens


def run_prefix(args: argparse.Namespace) -> dict[str, Any]:
    from mmpipe import Pipeline, SamplingParams
    from mmpipe.captioning import caption_conversation

    path = args.model or build_checkpoint(args.checkpoint, args.shape)
    width, height = args.image_size
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(2)]
    work = args.workdir or tempfile.mkdtemp(prefix="mmpipe-bench-prefix-")
    files = write_jpegs(os.path.join(work, "images"), args.caption_files, size=min(width, height))
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    with Pipeline.from_pretrained(path, device=args.device, dtype=dtype) as pipe:
        scheduler, prompts = pipe.engine.scheduler, Prompts(pipe)
        filler = history_filler(pipe, images, args.history_tokens)
        turns = [prompts.prepare(conversation(images, filler, k)) for k in (1, 2, 3, 4)]
        prompt_tokens = pipe.processor.assemble(*turns[3]).prompt_len
        answered = [prompts.prepare(conversation(images, filler, k + 1)[:-1]) for k in (1, 2, 3)]  # turn k + reply

        def turn4(on: bool) -> tuple[float, int]:
            scheduler.prefix_caching = on
            pipe.reset_prefix_cache()
            for prompt in answered:  # the history as the conversation left it
                prompts.first_token(prompt)
            return prompts.first_token(turns[3])

        def repeated(on: bool) -> tuple[float, int]:
            scheduler.prefix_caching = on
            pipe.reset_prefix_cache()
            prompts.first_token(turns[3])
            return prompts.first_token(turns[3])

        def unseen() -> float:  # both caches empty: the ViT runs too
            pipe.engine.cache.clear()
            pipe.reset_prefix_cache()
            return prompts.first_token(turns[3])[0]

        for on in (True, False):  # warm-up: graphs, kernels, the encoder cache
            turn4(on), repeated(on)
        first_ms = 1e3 * statistics.median(unseen() for _ in range(args.repeats))
        ttft: dict[str, dict[str, Any]] = {}
        for name, measure in (("turn 4", turn4), ("identical request", repeated)):
            runs = {on: [measure(on) for _ in range(args.repeats)] for on in (False, True)}
            ttft[name] = {"off_ms": 1e3 * statistics.median(s for s, _ in runs[False]),
                          "on_ms": 1e3 * statistics.median(s for s, _ in runs[True]),
                          "cached_tokens": runs[True][0][1], "off_cached_tokens": runs[False][0][1],
                          "prompt_tokens": prompt_tokens}
            ttft[name]["speedup"] = ttft[name]["off_ms"] / ttft[name]["on_ms"]

        params = SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, temperature=0.0)
        convs = [caption_conversation(f, "Describe this image.") for f in files]

        def caption(on: bool) -> float:
            scheduler.prefix_caching = on
            pipe.engine.drain()
            pipe.engine.cache.clear()
            pipe.reset_prefix_cache()
            done, seconds = timed(lambda: sum(1 for _ in pipe.chat_stream(iter(convs), params)), pipe.device)
            assert done == len(convs)
            return len(convs) / seconds

        caption(True)  # warm-up
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for on in (False, True):
                rates[on].append(caption(on))
        scheduler.prefix_caching = True
        stats = pipe.stats()["prefix_cache"]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    result = {"device": device, "model": args.model or f"{SHAPES[args.shape].label} shape, random",
              "image_size": f"{width}x{height}", "repeats": args.repeats, "ttft": ttft, "unseen_ms": first_ms,
              "caption": {"files": len(files), "new_tokens": args.new_tokens, "off_images_per_s": max(rates[False]),
                          "on_images_per_s": max(rates[True]),
                          "change_pct": 100 * (max(rates[True]) / max(rates[False]) - 1)},
              "cache_after": stats}
    print(report(result))
    return result


def report(result: dict[str, Any]) -> str:
    rows = [[name, t["prompt_tokens"], t["cached_tokens"], f"{t['off_ms']:.2f}", f"{t['on_ms']:.2f}",
             f"{t['speedup']:.1f}x"] for name, t in result["ttft"].items()]
    out = f"{result['model']} on {result['device']}, {result['image_size']} images\n\n"
    out += table("Time to first token (ms, median), prefix cache off / on", ["request", "prompt tokens",
                 "cached tokens", "off", "on", "off / on"], rows)
    out += (f"\nTurn 4's prompt with both caches empty (its images encoded too): {result['unseen_ms']:.2f} ms, "
            f"{result['unseen_ms'] / result['ttft']['identical request']['on_ms']:.1f}x the identical request's "
            "time with the cache on.\n")
    c = result["caption"]
    out += "\n" + table(f"Captioning {c['files']} new files, {c['new_tokens']} tokens each (images/s, best run)",
                        ["off", "on", "change"], [[f"{c['off_images_per_s']:.1f}", f"{c['on_images_per_s']:.1f}",
                                                   f"{c['change_pct']:+.1f}%"]])
    return out
