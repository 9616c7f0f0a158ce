"""`mmpipe caption`'s command line: its flags, the combinations that cannot work (one clear message
each), and the sampling and Pipeline settings the flags give (the same for a local run and the
Ray job)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from mmpipe.app.arg_types import EXPERT_PARALLEL_HELP, positive, positive_number, scale_options
from mmpipe.app.caption_records import FORMATS
from mmpipe.vision.video_sampling import (
    CONTEXT_TOKENS,
    FPS,
    FRAME_MAX_TOKENS,
    FRAME_MIN_TOKENS,
    MAX_FRAMES,
    MIN_FRAMES,
    VideoOptions,
)

from mmpipe.captioning import DEFAULT_VIDEO_PROMPT, VIDEO_EXTENSIONS, caption_video_options, frame_min_pixels
from mmpipe.config import VIT_PARALLEL, VIT_PARALLEL_HELP, GraphMode
from mmpipe.errors import InputError
from mmpipe.integrations.ray_data import RAY_BATCH_SIZE, RAY_BATCHES_IN_FLIGHT
from mmpipe.quantization import QUANTIZATION_HELP, RUNTIME_QUANTIZATIONS

DESCRIPTION = ("Batch captioning of images and video clips: files, directories or globs in; one caption per file "
               "out. Video files (.mp4, .mov, .mkv, .webm, ...) are found among the images and captioned as videos.")
FORMAT_NAMES = ["txt", *FORMATS, "parquet"]  # parquet: --ray only


def _frames(value: str) -> int:
    number = positive(value)
    if number < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (frames are sampled in pairs), got {number}")
    return number


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from mmpipe.cli import CommandParser

    parser = parser or CommandParser(prog="mmpipe caption", description=DESCRIPTION)
    parser.add_argument("images", nargs="+", help="image and video files, directories (recursive) or glob patterns")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    out = parser.add_argument_group("outputs")
    out.add_argument("--format", choices=FORMAT_NAMES, default=None,
                     help="txt: a sidecar name.txt per image; jsonl: one line per image in --output; metadata: "
                          "metadata.jsonl for Hugging Face imagefolder; csv (default: jsonl with --output, else "
                          "print to stdout)")
    out.add_argument("--output", default=None, help="the jsonl / csv / metadata.jsonl file")
    out.add_argument("--output-dir", default=None, help="txt: write sidecars here, mirroring the input tree")
    policy = out.add_mutually_exclusive_group()
    policy.add_argument("--skip-existing", dest="policy", action="store_const", const="skip",
                        help="images that already have a caption are skipped (default)")
    policy.add_argument("--overwrite", dest="policy", action="store_const", const="overwrite",
                        help="replace existing captions")
    policy.add_argument("--append", dest="policy", action="store_const", const="append",
                        help="add the new caption after an existing one (see --separator)")
    out.add_argument("--separator", default="\n", help="between an existing caption and an appended one "
                     "(default a newline; CSV keeps a caption on one line, so there every newline, this one "
                     "included, becomes a space)")
    out.add_argument("--prefix", default="", help="text put before every caption (e.g. a trigger word)")
    out.add_argument("--suffix", default="", help="text put after every caption")
    out.add_argument("--errors-file", default=None, help="JSON lines (image, error) for every image that failed in "
                     "this run; each run starts the file afresh (a re-run retries earlier failures, so an image "
                     "that fails again is listed again)")
    prompts = parser.add_argument_group("prompt and sampling")
    group = prompts.add_mutually_exclusive_group()
    group.add_argument("--prompt", default=None, help="instruction (default: 'Describe this image.'; for videos "
                       "see --video-prompt)")
    group.add_argument("--prompt-file", default=None, help="read the instruction from this file")
    prompts.add_argument("--dir-prompts", action="store_true",
                         help="a prompt.txt in a file's folder (or the nearest parent within its input "
                              "directory) overrides the prompt for the images and videos below it")
    prompts.add_argument("--max-new-tokens", type=positive, default=64)
    prompts.add_argument("--min-new-tokens", type=int, default=0)
    prompts.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    prompts.add_argument("--top-p", type=float, default=None)
    prompts.add_argument("--top-k", type=int, default=None)
    prompts.add_argument("--repetition-penalty", type=float, default=None)
    prompts.add_argument("--seed", type=int, default=None, help="makes sampled captions reproducible")
    prompts.add_argument("--json-schema", metavar="FILE", default=None,
                         help="a JSON Schema file: each caption is then a JSON object (or value) that validates "
                              "against it, on one line; one cut off by --max-new-tokens is a failure")
    sizes = parser.add_argument_group("image size")
    sizes.add_argument("--min-pixels", type=positive, default=None,
                       help="smallest image area in pixels (default: the checkpoint's); smaller images are enlarged")
    sizes.add_argument("--max-pixels", type=positive, default=None,
                       help="largest image area in pixels (default: the checkpoint's); larger images are shrunk, "
                            "giving fewer image tokens")
    videos = parser.add_argument_group(
        "videos", "files ending in " + " ".join(VIDEO_EXTENSIONS) + " (any case) are captioned as videos: frames "
        "sampled and sized as Qwen's qwen_vl_utils does; every 2 frames cost the tokens of one image of the frame size")
    videos.add_argument("--video-prompt", default=None,
                        help=f"instruction for videos (default: --prompt or --prompt-file if given, else "
                             f"'{DEFAULT_VIDEO_PROMPT}'); a --dir-prompts prompt.txt still wins")
    videos.add_argument("--fps", type=positive_number, default=None,
                        help=f"frames sampled per second of video (default: {FPS:g})")
    videos.add_argument("--max-frames", type=_frames, default=None,
                        help=f"most frames sampled from one video (default: {MAX_FRAMES}); at least {MIN_FRAMES} "
                             "are sampled from a short clip unless this is lower")
    videos.add_argument("--video-max-pixels", type=positive, default=None,
                        help=f"largest area of one sampled frame in pixels (default: {FRAME_MAX_TOKENS} merged "
                             "tokens' worth, e.g. 602112 for 28-pixel tokens, less when --video-total-pixels "
                             "is shared by many frames); --max-pixels is for images only")
    videos.add_argument("--video-total-pixels", type=positive, default=None,
                        help="pixel budget of all of a video's frames together (default: Qwen's, 90%% of a "
                             f"{CONTEXT_TOKENS}-token context); a frame never goes below {FRAME_MIN_TOKENS} tokens")
    run_group = parser.add_argument_group("running")
    run_group.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    run_group.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)")
    run_group.add_argument("--quantization", default=None, choices=list(RUNTIME_QUANTIZATIONS),
                           help=QUANTIZATION_HELP)
    run_group.add_argument("--workers", type=positive, default=4, help="threads decoding images ahead")
    run_group.add_argument("--batch-size", type=positive, default=None,
                           help="most requests decoding together (default: the engine's 256)")
    run_group.add_argument("--gpus", type=positive, default=None,
                           help="data parallel: start one process per GPU (via accelerate); with --tp T, one "
                                "per T GPUs (--gpus 4 --tp 2: two replicas of two GPUs each)")
    run_group.add_argument("--tp", type=positive, default=1,
                           help="tensor parallel: split the language model over this many GPUs (the device's and "
                                "the next ones)")
    run_group.add_argument("--expert-parallel", action="store_true", help=EXPERT_PARALLEL_HELP)
    run_group.add_argument("--vit-parallel", default=None, choices=list(VIT_PARALLEL), help=VIT_PARALLEL_HELP)
    run_group.add_argument("--gpu-decode", action="store_true",
                           help="decode and resize JPEG files on the GPU (nvJPEG; needs torchvision), as "
                                "transformers' torchvision-backed processor does; other files use Pillow")
    run_group.add_argument("--fail-fast", action="store_true", help="stop at the first file that fails")
    run_group.add_argument("--ray", action="store_true",
                           help="run as a Ray Data job; --output is then a directory of JSON lines (or --format "
                                "parquet) files, on a filesystem every node sees (needs mmpipe[ray])")
    run_group.add_argument("--ray-address", default=None,
                           help="with --ray: the cluster (default: $RAY_ADDRESS, else a running one, else a local one)")
    run_group.add_argument("--ray-actors", type=positive, default=None,
                           help="with --ray: pipelines (actors) to run, one GPU each (default: the cluster's GPUs)")
    run_group.add_argument("--ray-batch-size", type=positive, default=None,
                           help=f"with --ray: images per Ray batch (default: {RAY_BATCH_SIZE})")
    run_group.add_argument("--ray-batches-in-flight", type=positive, default=None,
                           help=f"with --ray: batches each actor captions at once (default: {RAY_BATCHES_IN_FLIGHT}); "
                                "their requests share the actor's engine")
    run_group.add_argument("--vit-graphs", action=argparse.BooleanOptionalAction, default=None,
                           help="CUDA graphs for the vision encoder (default: on with CUDA)")
    run_group.add_argument("--graph-mode", default=None, choices=[m.value for m in GraphMode],
                           help="CUDA graphs for the language model (default: full_and_piecewise on CUDA)")
    run_group.add_argument("--quiet", action="store_true", help="no progress bars and no summary")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Command-line combinations that cannot work, as one clear message."""
    fmt = args.format or ("jsonl" if args.output else None)
    args.format = fmt
    args.policy = args.policy or "skip"
    if fmt in ("jsonl", "csv") and not args.output:
        raise InputError(f"--format {fmt} needs --output FILE")
    if fmt == "txt" and args.output:
        raise InputError("--format txt writes one file per image: use --output-dir DIR, not --output")
    if args.output_dir and fmt != "txt":
        raise InputError("--output-dir is for --format txt")
    if fmt is None and args.policy != "skip":
        raise InputError("--overwrite / --append need an output (--format or --output)")
    if args.min_pixels is not None and args.max_pixels is not None and args.min_pixels > args.max_pixels:
        raise InputError(f"--min-pixels ({args.min_pixels}) must not be above --max-pixels ({args.max_pixels})")
    if args.min_new_tokens < 0 or args.min_new_tokens > args.max_new_tokens:
        raise InputError(f"--min-new-tokens must be between 0 and --max-new-tokens ({args.max_new_tokens})")
    if args.output and os.path.isdir(args.output) and not args.ray:
        raise InputError(f"--output {args.output} is a directory")
    if args.json_schema is not None:
        if args.prefix or args.suffix:
            raise InputError("--json-schema writes JSON captions: --prefix and --suffix would break them")
        sampling_params(args)  # a file that cannot be read or a schema that is not one: said now, not per image


def video_options(args: argparse.Namespace) -> VideoOptions:
    """How every video is sampled and sized (`--fps`, `--max-frames`, `--video-max-pixels`,
    `--video-total-pixels`), checked before the model loads: a --video-max-pixels below a frame's
    smallest area (for the checkpoint's patch size) is refused here, not once per video."""
    given = {"fps": args.fps, "max_frames": args.max_frames, "max_pixels": args.video_max_pixels,
             "total_pixels": args.video_total_pixels}
    options = caption_video_options(given, where="video options")
    factor = _checkpoint_factor(args.model) if args.video_max_pixels is not None else None
    if factor is not None and args.video_max_pixels < frame_min_pixels(factor):
        raise InputError(f"--video-max-pixels {args.video_max_pixels} is below a video frame's smallest area, "
                         f"{frame_min_pixels(factor)} pixels ({FRAME_MIN_TOKENS} tokens of {factor}x{factor} pixels)")
    return options


def _checkpoint_factor(model: str | None) -> int | None:
    """The checkpoint's patch size x merge size, from its preprocessor config (None when it
    cannot be read: the model load reports that)."""
    from mmpipe.vision.preprocess import ImageProcessorConfig

    from mmpipe.errors import MmpipeError
    from mmpipe.pipeline import default_model_path

    try:
        return ImageProcessorConfig.from_dir(model or default_model_path()).factor
    except (MmpipeError, OSError, ValueError):
        return None


def sampling_params(args: argparse.Namespace) -> Any:
    from mmpipe import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          json_schema=_json_schema(args.json_schema))


def _json_schema(path: str | None) -> str | None:
    """The --json-schema file's text (SamplingParams checks that it is a JSON object)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--json-schema {path}: cannot read it ({exc})") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise InputError(f"--json-schema {path}: not JSON ({exc})") from None
    return text


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Pipeline settings the command's flags give, for the local run and the Ray job alike."""
    options: dict[str, Any] = {"preprocess_workers": args.workers, "image_decode": "gpu" if args.gpu_decode else "cpu",
                               **scale_options(args)}
    for name in ("min_pixels", "max_pixels"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.vit_graphs is not None:
        from mmpipe import EngineConfig

        options["vit_graph"] = dataclasses.replace(EngineConfig().vit_graph, enabled=args.vit_graphs)
    return options
