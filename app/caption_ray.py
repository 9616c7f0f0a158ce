"""`mmpipe caption --ray [ADDRESS]`: the same captioning as a Ray Data job
(`mmpipe.integrations.ray_data.caption_files`) on a running Ray cluster, or a local one: the
output is a directory of JSON lines (or Parquet) files, one row per image or video, and the same command
started again captions only what is missing."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mmpipe.errors import InputError, MmpipeError


def run_ray(args: argparse.Namespace, paths: list[str], prompt: str | None, sampling: Any, video: Any = None) -> int:
    from mmpipe.integrations.ray_data import RAY_BATCH_SIZE, RAY_BATCHES_IN_FLIGHT, _ray, caption_files

    problem = _unsupported(args)
    if problem is not None:
        print(f"mmpipe caption: {problem}", file=sys.stderr)
        return 2
    try:
        ray = _ray()
    except InputError as exc:
        print(f"mmpipe caption: {exc}", file=sys.stderr)
        return 2
    if not ray.is_initialized():
        try:
            ray.init(address=args.ray_address, log_to_driver=False)
        except Exception as exc:  # Ray raises its own types (ConnectionError, ValueError, ...)
            print(f"mmpipe caption: cannot start or join the Ray cluster ({args.ray_address or 'default'}): "
                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
            return 2
    gpus = int(ray.cluster_resources().get("GPU", 0)) if args.device != "cpu" else 0
    actors = args.ray_actors or max(1, gpus // args.tp)  # an actor holds --tp GPUs
    if gpus and actors * args.tp > gpus:
        print(f"mmpipe caption: --ray-actors {actors} with --tp {args.tp} needs {actors * args.tp} GPUs; the cluster "
              f"has {gpus}", file=sys.stderr)
        return 2
    from mmpipe.app.caption_args import engine_options

    engine = engine_options(args)
    if args.graph_mode:
        engine["graph_mode"] = args.graph_mode
    fields = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")
    try:
        summary = caption_files(paths, args.output, model=args.model, prompt=prompt,
                                sampling={name: getattr(sampling, name) for name in fields}, engine=engine,
                                format=args.format or "jsonl", concurrency=actors, num_gpus=args.tp if gpus else 0,
                                device=args.device, dtype=args.dtype, video_prompt=args.video_prompt,
                                video=video.given() if video is not None else None,
                                batch_size=args.ray_batch_size or RAY_BATCH_SIZE,
                                batches_in_flight=args.ray_batches_in_flight or RAY_BATCHES_IN_FLIGHT)
    except MmpipeError as exc:
        print(f"mmpipe caption: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a Ray task or actor failed for good (e.g. the model did not load)
        print(f"mmpipe caption: the Ray job failed: {_root_cause(exc)}", file=sys.stderr)
        return 1
    if not args.quiet:
        from mmpipe.captioning import is_video

        noun = "file(s)" if any(is_video(path) for path in paths) else "image(s)"
        print(f"captioned {summary['captioned']} {noun} with {actors} Ray actor(s), {summary['failed']} failed, "
              f"{summary['already']} already in {args.output}; {summary['error_rows']} error row(s) there in all "
              "(an error row is not retried)", file=sys.stderr)
    return 1 if summary["error_rows"] else 0


def _unsupported(args: argparse.Namespace) -> str | None:
    """Flags of the single-machine tool that the Ray job does not do, as one message."""
    if not args.output:
        return "--ray writes a directory of row files: give it with --output DIR"
    if args.format not in (None, "jsonl", "parquet"):
        return f"--ray writes jsonl or parquet files, not {args.format}"
    given = [flag for flag, on in (("--overwrite/--append", args.policy not in (None, "skip")),
                                   ("--dir-prompts", args.dir_prompts), ("--prefix", bool(args.prefix)),
                                   ("--suffix", bool(args.suffix)), ("--errors-file", bool(args.errors_file)),
                                   ("--fail-fast", args.fail_fast), ("--output-dir", bool(args.output_dir)),
                                   ("--vit-graphs", args.vit_graphs is not None)) if on]
    if given:
        return f"--ray does not take {', '.join(given)} (errors are rows with an `error` column)"
    return None


def _root_cause(exc: BaseException) -> str:
    """The error behind a Ray failure: Ray's message carries the remote traceback, whose last
    `...Error: message` line is the cause (an mmpipe error where the Pipeline could not start)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    causes = [line for line in lines if line.startswith("mmpipe.errors.")]
    if causes:
        return causes[-1].removeprefix("mmpipe.errors.")
    errors = [line for line in lines if ": " in line and line.split(":", 1)[0].endswith(("Error", "Exception"))]
    return errors[-1] if errors else f"{type(exc).__name__}: {lines[0] if lines else ''}"
