"""`mmpipe bench video`: captioning video clips, mmpipe against transformers in one process on one
GPU, and the host memory of reading one long video.

1. Clips: `--clips` H.264 mp4 files of `--seconds` at `--source-fps` and `--size`, each with its
   own content (no encoder cache hits), written once into `--workdir` and reused
   (`app/bench/video_clips.py`), sampled at `--fps`, `--new-tokens` tokens each (end of sequence
   ignored, greedy), Qwen2.5-VL-3B-shaped random weights in bfloat16.
2. mmpipe: `Pipeline.chat` on all clips in one call, after a warm-up on two other clips. Figures:
   clips/s, output tokens/s, wall seconds, the process's CPU seconds per clip (all threads), and
   the GPU's busy share over the timed call (`app/bench/gpu_busy.py`; `--timeline PNG` adds a
   profiled pass with the trace's busy share and GPU time per phase).
3. transformers: `--hf-clips` of the clips through its own processor and `generate` in batches
   of `--hf-batch`, fed the frames mmpipe samples (`app/bench/video_systems.py`); the speedup is
   mmpipe's clips/s over transformers'.
4. A long video (`--long-minutes` at `--long-size`, `--long-fps`) read by mmpipe's video loading in
   a fresh process: its peak resident memory, frames and grid (`app/bench/video_memory.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import traceback
from typing import Any

from mmpipe.app.bench.results import table
from mmpipe.app.bench.video_clips import ClipSpec, parse_size, write_clips, write_long

WARMUP_SEEDS = (900_001, 900_002)  # the warm-up clips' content differs from every timed clip's


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = parse_size(text)
        ClipSpec(1.0, 1.0, width, height)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return width, height


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clips", type=int, default=64, help="clips mmpipe captions (timed)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each clip")
    parser.add_argument("--source-fps", type=float, default=30.0, help="frame rate the clips are written at")
    parser.add_argument("--size", type=_size, default=(640, 360), help="clip frame size, WIDTHxHEIGHT")
    parser.add_argument("--fps", type=float, default=2.0,
                        help="frames sampled per second of video (Qwen's default)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per clip")
    parser.add_argument("--prompt", default="Describe this video.")
    parser.add_argument("--hf-batch", type=int, default=8, help="transformers' generate batch size (left padding)")
    parser.add_argument("--hf-clips", type=int, default=16, help="clips transformers captions (the first ones)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    parser.add_argument("--long-minutes", type=float, default=10.0, help="length of the long video")
    parser.add_argument("--long-size", type=_size, default=(1920, 1080), help="long video frame size, WIDTHxHEIGHT")
    parser.add_argument("--long-fps", type=float, default=30.0, help="the long video's frame rate")
    parser.add_argument("--skip-long", action="store_true", help="do not write or read the long video")
    parser.add_argument("--timeline", default=None, help="also profile one mmpipe pass over --timeline-clips "
                        "clips and draw it here (PNG; needs matplotlib)")
    parser.add_argument("--timeline-clips", type=int, default=16)
    parser.add_argument("--engine", default=None, help="EngineConfig overrides as JSON")
    parser.add_argument("--encode-workers", type=int, default=os.cpu_count() or 1,
                        help="processes writing the video files")
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random 3B-shaped checkpoint here")
    parser.add_argument("--workdir", default=None, help="where the video files go, reused by later runs "
                        "(default: mmpipe-bench-video in the temporary folder)")


def clip_spec(args: argparse.Namespace) -> ClipSpec:
    return ClipSpec(args.seconds, args.source_fps, *args.size)


def long_spec(args: argparse.Namespace) -> ClipSpec:
    return ClipSpec(args.long_minutes * 60, args.long_fps, *args.long_size, preset="ultrafast")


def write_files(args: argparse.Namespace, workdir: str) -> tuple[list[str], list[str], str | None]:
    """(timed clips, warm-up clips, long video or None), written where missing."""
    count = max(args.clips, 0 if args.skip_hf else args.hf_clips)
    spec = clip_spec(args)
    paths = write_clips(os.path.join(workdir, "clips"), spec, [*range(1, count + 1), *WARMUP_SEEDS],
                        args.encode_workers)
    long = None if args.skip_long else write_long(os.path.join(workdir, "long"), long_spec(args),
                                                  workers=args.encode_workers)
    return paths[:count], paths[count:], long


def _check_video_template(checkpoint: str) -> None:
    """A checkpoint written before the synthetic chat template knew video parts renders none."""
    texts = []
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = os.path.join(checkpoint, name)
        if os.path.isfile(path):
            with open(path) as handle:
                texts.append(handle.read())
    if texts and not any("video_pad" in text for text in texts):
        raise SystemExit(f"{checkpoint}: its chat template has no video part (written by an older mmpipe); "
                         "remove the folder or pass another --checkpoint to build it again")


def versions() -> dict[str, str]:
    import av
    import torch
    import transformers

    import mmpipe

    return {"torch": torch.__version__, "transformers": transformers.__version__, "av": av.__version__,
            "mmpipe": getattr(mmpipe, "__version__", "")}


def run_video(args: argparse.Namespace) -> dict[str, Any]:
    import time

    import torch
    from mmpipe.app.bench.shapes import SHAPES, build_checkpoint
    from mmpipe.app.bench.video_memory import long_video_memory
    from mmpipe.app.bench.video_systems import SYSTEMS, RunOptions

    if args.clips < 1:
        raise SystemExit("--clips must be at least 1")
    workdir = args.workdir or os.path.join(tempfile.gettempdir(), "mmpipe-bench-video")
    start = time.perf_counter()
    _log(f"writing (or finding) the video files in {workdir}")
    clips, warmup, long = write_files(args, workdir)  # before CUDA starts: the writers are spawned processes
    written_s = time.perf_counter() - start
    _log(f"files ready in {written_s:.1f} s; the checkpoint")
    checkpoint = build_checkpoint(args.checkpoint, "3b")
    _check_video_template(checkpoint)
    options = RunOptions(fps=args.fps, new_tokens=args.new_tokens, prompt=args.prompt, hf_batch=args.hf_batch,
                         engine=json.loads(args.engine or "{}"), timeline=args.timeline,
                         timeline_clips=args.timeline_clips)
    spec = clip_spec(args)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "versions": versions(), "arguments": _plain(vars(args)),
        "command": shlex.join(sys.argv),
        "checkpoint": checkpoint, "shape": SHAPES["3b"].label, "workdir": workdir, "files_written_s": written_s,
        "clip_frames": spec.frames, "clip_size": [spec.width, spec.height], "clip_source_fps": spec.fps,
        "sample_fps": args.fps, "new_tokens": args.new_tokens, **clip_geometry(clips[0], args.fps, checkpoint)}
    _log(f"mmpipe: {args.clips} clips")
    result.update(SYSTEMS["mmpipe"](checkpoint, clips[:args.clips], warmup, options))
    if not args.skip_hf and args.hf_clips > 0:
        _log(f"transformers: {args.hf_clips} clips")
        if _attempt(result, "hf", lambda: SYSTEMS["transformers"](checkpoint, clips[:args.hf_clips], warmup,
                                                                   options)):
            result["speedup"] = result["mmpipe_clips_per_s"] / result["hf_clips_per_s"]
    if long is not None:
        _log(f"the long video, in a new process: {long}")
        if _attempt(result, "long_video", lambda: long_video_memory(checkpoint, long, args.fps)):
            result.update({"long_video_minutes": args.long_minutes, "long_video_size": list(args.long_size)})
    print(report(result))
    return result


def _attempt(result: dict[str, Any], name: str, part: Any) -> bool:
    """Run one part of the bench; a failure is recorded as `<name>_error` and the rest still runs."""
    try:
        result.update(part())
    except Exception as exc:  # noqa: BLE001 - one system failing must not lose the others' figures
        traceback.print_exc()
        result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        return False
    return True


def _log(message: str) -> None:
    print(f"[bench video] {message}", file=sys.stderr, flush=True)


def clip_geometry(path: str, fps: float, checkpoint: str) -> dict[str, Any]:
    """What the model sees of one clip: frames sampled, their size, the grid and its tokens."""
    from mmpipe.vision.preprocess import ImageProcessorConfig
    from mmpipe.vision.video_sampling import VideoOptions, frame_size, sample_frames

    from mmpipe.video_reader import VideoFile

    cfg = ImageProcessorConfig.from_dir(checkpoint)
    options = VideoOptions(fps=fps)
    with VideoFile(path) as file:
        info = file.info
    sample = sample_frames(options, info.total_frames, info.fps)
    height, width = frame_size(info.height, info.width, len(sample.indices), options, cfg.factor)
    grid = [-(-len(sample.indices) // cfg.temporal_patch_size), height // cfg.patch_size, width // cfg.patch_size]
    return {"frames_per_clip": len(sample.indices), "frame_size": [width, height], "video_grid_thw": grid,
            "video_tokens_per_clip": grid[0] * grid[1] * grid[2] // cfg.merge_size ** 2}


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def report(result: dict[str, Any]) -> str:
    """The results as markdown tables (what `run_video` prints)."""
    width, height = result.get("clip_size", ["?", "?"])
    lines = [(f"{result.get('shape', '')}-shaped random weights, bfloat16, {result.get('gpu', '')}; "
             f"clips of {result.get('clip_frames')} frames at {_fmt(result.get('clip_source_fps'))} fps, "
             f"{width}x{height}, sampled at {_fmt(result.get('sample_fps'))} fps: {result.get('frames_per_clip')} "
             f"frames of {'x'.join(map(str, result.get('frame_size', [])))}, grid {result.get('video_grid_thw')}, "
             f"{result.get('video_tokens_per_clip')} video tokens per clip; {result.get('new_tokens')} new tokens "
             "each; file decoding included"), ""]
    rows = []
    for prefix, name in (("mmpipe", "mmpipe Pipeline.chat"),
                         ("hf", f"transformers generate, batches of {result.get('hf_batch')}")):
        if f"{prefix}_clips" not in result:
            continue
        speed = result.get("speedup") if prefix == "mmpipe" else (1.0 if "speedup" in result else None)
        busy = result.get(f"{prefix}_gpu_busy")
        rows.append([name, result[f"{prefix}_clips"], _fmt(result[f"{prefix}_seconds"]),
                     _fmt(result[f"{prefix}_clips_per_s"]), _fmt(result[f"{prefix}_output_tokens_per_s"], 4),
                     _fmt(result[f"{prefix}_cpu_s_per_clip"]), "-" if busy is None else f"{busy:.0%}",
                     "-" if speed is None else f"{speed:.1f}x"])
    if rows:
        lines.append(table("Video clips, same process", ["system", "clips", "seconds", "clips/s", "output tok/s",
                                                          "CPU s per clip", "GPU busy", "vs transformers"], rows))
        methods = {result.get(f"{p}_gpu_busy_method") for p in ("mmpipe", "hf") if f"{p}_clips" in result}
        lines.append("GPU busy: " + "; ".join(sorted(m for m in methods if m)))
        captures = result.get("mmpipe_vit_captures_in_timed_run")
        if captures:
            lines.append(f"note: mmpipe captured {captures} ViT graph(s) during the timed run, in "
                         f"{_fmt(result.get('mmpipe_vit_capture_s_in_timed_run'))} s")
        lines.append("")
    for name in ("hf", "long_video"):
        if result.get(f"{name}_error"):
            lines.append(f"{'transformers' if name == 'hf' else 'long video'} failed: {result[f'{name}_error']}\n")
    timeline = result.get("mmpipe_timeline")
    if timeline:
        keys = ["seconds", "gpu_busy", "gpu_vision", "gpu_prefill", "gpu_decode", "gpu_other"]
        lines.append(table("mmpipe, one profiled pass (fractions of its wall time)", keys,
                           [[_fmt(timeline.get(k)) for k in keys]]))
    if "long_video_peak_rss_gb" in result:
        size = result.get("long_video_source_size", ["?", "?"])
        lines.append(table(
            "Host memory reading one long video (mmpipe's video loading, fresh process)",
            ["video", "frames sampled", "frame size", "grid", "tokens", "load s", "peak RSS GB",
             "RSS before GB", "frames held GB"],
            [[(f"{_fmt(result.get('long_video_minutes'))} min, {size[0]}x{size[1]}, "
               f"{result.get('long_video_source_frames')} frames"), result.get("long_video_frames"),
              "x".join(map(str, result.get("long_video_frame_size", []))),
              result.get("long_video_grid_thw"), result.get("long_video_tokens"),
              _fmt(result.get("long_video_load_s")), _fmt(result.get("long_video_peak_rss_gb")),
              _fmt(result.get("long_video_rss_before_gb")), _fmt(result.get("long_video_frames_gb"))]]))
    return "\n".join(lines)
