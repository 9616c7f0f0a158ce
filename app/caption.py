"""Batch image captioning: files, directories or globs in; one caption per image out.

    mmpipe caption assets/images                                  # print "path<TAB>caption"
    mmpipe caption photos/ --format txt                           # photos/a.jpg -> photos/a.txt
    mmpipe caption photos/ --format txt --output-dir captions/    # mirrored under captions/
    mmpipe caption photos/ --format jsonl --output captions.jsonl
    mmpipe caption photos/ --format metadata                      # photos/metadata.jsonl (imagefolder)
    mmpipe caption photos/ --format csv --output captions.csv
    mmpipe caption photos/ --format txt --gpus 2                  # data parallel, one process per GPU

Every image goes through one continuous stream of engine requests (images decoded on
`--workers` threads a bounded distance ahead), and each caption is written the moment it
completes. Existing captions are skipped (`--skip-existing`, the default), replaced
(`--overwrite`) or extended (`--append`). A run killed at any moment and started again with
the same command captions every image exactly once (see `caption_io`). An unreadable image is
reported once on stderr (and in `--errors-file`) and skipped; the exit code is 1 if any image
or input failed, 2 for a usage error.

Several processes (`--gpus N`, `accelerate launch -m mmpipe.app.caption ...` or `torchrun`)
each caption a deterministic shard of the sorted images with their own Pipeline; sidecars need
no merge, record files are written per process and merged by the first process at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Sequence

from mmpipe.app.caption_io import (
    FORMATS,
    ErrorLog,
    ImageItem,
    PromptResolver,
    RecordSink,
    SidecarSink,
    Sink,
    StdoutSink,
    collect_images,
    read_prompt_file,
    remove_stale_temporaries,
    shard,
    unwritable,
)

from mmpipe.config import VIT_PARALLEL, VIT_PARALLEL_HELP, GraphMode
from mmpipe.errors import InputError
from mmpipe.integrations.ray_data import RAY_BATCH_SIZE, RAY_BATCHES_IN_FLIGHT
from mmpipe.quantization import QUANTIZATION_HELP, RUNTIME_QUANTIZATIONS

FORMAT_NAMES = ["txt", *FORMATS, "parquet"]  # parquet: --ray only


WARM_UP_SAMPLE = 4  # files whose sizes decide the ViT graphs captured before the run


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from mmpipe.cli import CommandParser

    parser = parser or CommandParser(prog="mmpipe caption", description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="image files, directories (recursive) or glob patterns")
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
    group.add_argument("--prompt", default=None, help="instruction (default: 'Describe this image.')")
    group.add_argument("--prompt-file", default=None, help="read the instruction from this file")
    prompts.add_argument("--dir-prompts", action="store_true",
                         help="a prompt.txt in an image's folder (or the nearest parent within its input "
                              "directory) overrides the prompt for the images below it")
    prompts.add_argument("--max-new-tokens", type=_positive, default=64)
    prompts.add_argument("--min-new-tokens", type=int, default=0)
    prompts.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    prompts.add_argument("--top-p", type=float, default=None)
    prompts.add_argument("--top-k", type=int, default=None)
    prompts.add_argument("--repetition-penalty", type=float, default=None)
    prompts.add_argument("--seed", type=int, default=None, help="makes sampled captions reproducible")
    sizes = parser.add_argument_group("image size")
    sizes.add_argument("--min-pixels", type=_positive, default=None,
                       help="smallest image area in pixels (default: the checkpoint's); smaller images are enlarged")
    sizes.add_argument("--max-pixels", type=_positive, default=None,
                       help="largest image area in pixels (default: the checkpoint's); larger images are shrunk, "
                            "giving fewer image tokens")
    run_group = parser.add_argument_group("running")
    run_group.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    run_group.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)")
    run_group.add_argument("--quantization", default=None, choices=list(RUNTIME_QUANTIZATIONS),
                           help=QUANTIZATION_HELP)
    run_group.add_argument("--workers", type=_positive, default=4, help="threads decoding images ahead")
    run_group.add_argument("--batch-size", type=_positive, default=None,
                           help="most requests decoding together (default: the engine's 256)")
    run_group.add_argument("--gpus", type=_positive, default=None,
                           help="data parallel: start one process per GPU (via accelerate); with --tp T, one "
                                "per T GPUs (--gpus 4 --tp 2: two replicas of two GPUs each)")
    run_group.add_argument("--tp", type=_positive, default=1,
                           help="tensor parallel: split the language model over this many GPUs (the device's and "
                                "the next ones)")
    run_group.add_argument("--vit-parallel", default=None, choices=list(VIT_PARALLEL), help=VIT_PARALLEL_HELP)
    run_group.add_argument("--gpu-decode", action="store_true",
                           help="decode and resize JPEG files on the GPU (nvJPEG; needs torchvision), as "
                                "transformers' torchvision-backed processor does; other files use Pillow")
    run_group.add_argument("--fail-fast", action="store_true", help="stop at the first image that fails")
    run_group.add_argument("--ray", action="store_true",
                           help="run as a Ray Data job; --output is then a directory of JSON lines (or --format "
                                "parquet) files, on a filesystem every node sees (needs mmpipe[ray])")
    run_group.add_argument("--ray-address", default=None,
                           help="with --ray: the cluster (default: $RAY_ADDRESS, else a running one, else a local one)")
    run_group.add_argument("--ray-actors", type=_positive, default=None,
                           help="with --ray: pipelines (actors) to run, one GPU each (default: the cluster's GPUs)")
    run_group.add_argument("--ray-batch-size", type=_positive, default=None,
                           help=f"with --ray: images per Ray batch (default: {RAY_BATCH_SIZE})")
    run_group.add_argument("--ray-batches-in-flight", type=_positive, default=None,
                           help=f"with --ray: batches each actor captions at once (default: {RAY_BATCHES_IN_FLIGHT}); "
                                "their requests share the actor's engine")
    run_group.add_argument("--vit-graphs", action=argparse.BooleanOptionalAction, default=None,
                           help="CUDA graphs for the vision encoder (default: on with CUDA)")
    run_group.add_argument("--graph-mode", default=None, choices=[m.value for m in GraphMode],
                           help="CUDA graphs for the language model (default: full_and_piecewise on CUDA)")
    run_group.add_argument("--quiet", action="store_true", help="no progress bars and no summary")
    return parser


@dataclasses.dataclass
class Tally:
    captioned: int = 0
    already: int = 0
    failed: int = 0
    unmatched_inputs: int = 0
    tokens: int = 0
    captured_during_run: int = 0  # graphs captured after the run started (the start-up missed them)


def _check(args: argparse.Namespace) -> None:
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


def _sampling(args: argparse.Namespace) -> Any:
    from mmpipe import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, seed=args.seed)


def _make_sink(args: argparse.Namespace, part: str = "") -> Sink:
    if args.format is None:
        return StdoutSink(sys.stdout)
    if args.format == "txt":
        return SidecarSink(args.policy, args.output_dir, args.separator, _run_id(args))
    output = args.output + part if args.output else None
    return RecordSink(args.format, args.policy, output, args.separator, part=part)


def _output_paths(args: argparse.Namespace, items: list[ImageItem], part: str) -> list[str]:
    """Every file this run will write its captions to (none for stdout)."""
    if args.format == "txt":
        sidecars = SidecarSink(args.policy, args.output_dir, args.separator, _run_id(args))
        return [sidecars.target(item) for item in items]
    if args.format in FORMATS:  # one given file, or one metadata.jsonl per dataset folder
        return sorted({(args.output or os.path.join(item.root, "metadata.jsonl")) + part for item in items})
    return []


def _run_id(args: argparse.Namespace) -> str:
    """Names the sidecar journal: the same command finds the same journal when it resumes."""
    import hashlib

    return hashlib.sha256(repr((args.policy, args.prefix, args.suffix, args.separator)).encode()).hexdigest()[:12]


def run(args: argparse.Namespace) -> int:
    ray_only = [flag for flag, value in (("--ray-address", args.ray_address), ("--ray-actors", args.ray_actors),
                                         ("--ray-batch-size", args.ray_batch_size),
                                         ("--ray-batches-in-flight", args.ray_batches_in_flight)) if value is not None]
    if ray_only and not args.ray:
        print(f"mmpipe caption: {', '.join(ray_only)} need(s) --ray", file=sys.stderr)
        return 2
    if args.ray and (args.gpus or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        print("mmpipe caption: --ray runs its own actors (--ray-actors); not with --gpus or a multi-process launcher",
              file=sys.stderr)
        return 2
    if args.gpus and args.gpus % args.tp:
        print(f"mmpipe caption: --gpus {args.gpus} is not a multiple of --tp {args.tp}", file=sys.stderr)
        return 2
    replicas = args.gpus // args.tp if args.gpus else 1
    if replicas > 1 and not under_launcher():
        return _launch_processes(replicas, args.gpus)
    try:
        _check(args)
        prompt = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
        sampling = _sampling(args)
    except (InputError, ValueError) as exc:
        print(f"mmpipe caption: {exc}", file=sys.stderr)
        return 2
    if args.format == "parquet" and not args.ray:
        print("mmpipe caption: --format parquet is for --ray (a directory of Parquet files)", file=sys.stderr)
        return 2
    # The Ray driver never touches a GPU (no accelerate state): its actors have them.
    state = None if args.ray else _process_state(cpu=args.device == "cpu")
    items, problems = collect_images(args.images)
    if state is None or state.is_main_process:
        for problem in problems:
            print(f"mmpipe caption: {problem}", file=sys.stderr)
    if not items:
        print("mmpipe caption: no images to caption", file=sys.stderr)
        return 2
    if state is None:
        from mmpipe.app.caption_ray import run_ray

        return run_ray(args, [item.path for item in items], prompt, sampling)
    if args.format == "metadata" and args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        outside = [i.path for i in items if os.path.relpath(i.path, folder).startswith("..")]
        if outside:
            print(f"mmpipe caption: metadata file {args.output}: {outside[0]} is not under its folder "
                  "(imagefolder's file_name must be relative)", file=sys.stderr)
            return 2
    world, rank = state.num_processes, state.process_index
    mine = shard(items, rank, world) if world > 1 else items
    if world > 1 and args.format in FORMATS and args.policy != "skip":
        print("mmpipe caption: --overwrite / --append with a record file need one process", file=sys.stderr)
        return 2
    part = f".part{rank}of{world}" if world > 1 and args.format in FORMATS else ""
    errors_path = args.errors_file + (f".part{rank}of{world}" if world > 1 else "") if args.errors_file else None
    problem = unwritable(_output_paths(args, mine, part) + ([errors_path] if errors_path else []))
    if problem is not None:  # before the model loads: no captioning work is lost
        print(f"mmpipe caption: {problem}", file=sys.stderr)
        return 2
    sink = _make_sink(args, part)
    errors = ErrorLog(errors_path)
    tally = Tally(unmatched_inputs=len(problems) if state.is_main_process else 0)
    try:
        code = _caption(args, state, mine, prompt, sampling, sink, errors, tally)
        if world > 1:
            mark_shard_captioned(rank)
    except OSError as exc:  # a write failed mid-run (disk full, the folder gone, ...)
        print(f"mmpipe caption: cannot write {exc.filename or 'the output'}: {exc.strerror or exc}; "
              f"the {tally.captioned} caption(s) written before it are kept (run the same command again "
              "to caption the rest)", file=sys.stderr)
        code = 1
    finally:
        for closing in (errors.close, sink.close):
            try:
                closing()
            except OSError:  # already reported; what was written before stays
                pass
    if world > 1:
        state.wait_for_everyone()
        if state.is_main_process:
            _merge_parts(args, items, world)
    return code


def _caption(args: argparse.Namespace, state: Any, items: list[ImageItem], prompt: str | None, sampling: Any,
             sink: Sink, errors: ErrorLog, tally: Tally) -> int:
    from tqdm import tqdm

    from mmpipe import Pipeline
    from mmpipe.errors import MmpipeError
    from mmpipe.pipeline import caption_conversation, caption_result

    if isinstance(sink, SidecarSink):
        remove_stale_temporaries(os.path.dirname(sink.target(i)) for i in items)
        targets: dict[str, ImageItem] = {}
        clashes = []
        for item in items:
            other = targets.setdefault(sink.target(item), item)
            if other is not item:
                clashes.append((item, other))
        for item, other in clashes:
            message = f"its caption file {sink.target(item)} is also {other.path}'s"
            _report(item, message, errors, None)
            tally.failed += 1
        clashing = {item.key for item, _ in clashes}
        items = [i for i in items if i.key not in clashing]
    todo = [i for i in items if not sink.done(i)]
    tally.already = len(items) - len(todo)
    resolve = PromptResolver(prompt or "Describe this image.", args.dir_prompts)
    options = {**engine_options(args), "startup_progress": not args.quiet}
    if not todo:
        sink.finish()
        if not args.quiet:
            _summary(tally, 0.0, sink, args, state)
        return 1 if tally.failed or tally.unmatched_inputs else 0
    device = args.device if args.device or state.num_processes == 1 else replica_device(state.local_process_index,
                                                                                        args.tp)
    if args.tp > 1 and state.num_processes > 1 and device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)  # accelerate made cuda:<index> current; the replica starts at cuda:<index * tp>
    try:
        pipe = Pipeline.from_pretrained(args.model, device=device, dtype=args.dtype, graph_mode=args.graph_mode,
                                        startup_sampling=sampling, **options)
    except MmpipeError as exc:
        print(f"mmpipe caption: {exc}", file=sys.stderr)
        return 2
    # The ViT graphs packs of these images will use and the decode graphs of this sampling,
    # captured before the first step (a run of equal-sized images then captures nothing once started).
    pipe.warm_up([item.path for item in todo[:WARM_UP_SAMPLE]], sampling)
    captures_at_start = _captures(pipe)
    start = time.monotonic()
    bar = tqdm(total=len(todo), unit="img", disable=args.quiet or not todo, file=sys.stderr, dynamic_ncols=True,
               position=state.process_index, desc=f"rank {state.process_index}" if state.num_processes > 1 else None)
    stopped = False
    conversations = (caption_conversation(item.path, resolve(item)) for item in todo)
    stream = pipe.chat_stream(conversations, sampling)
    try:
        for output in stream:
            item = todo[output.index]
            bar.update(1)
            tally.tokens += len(output.token_ids)
            text, reason = caption_result(output)
            if reason is not None:
                tally.failed += 1
                _report(item, reason, errors, bar)
                if args.fail_fast:
                    stopped = True
                    break
                continue
            if isinstance(sink, StdoutSink):
                bar.clear()
            sink.write(item, f"{args.prefix}{text}{args.suffix}")
            tally.captioned += 1
    finally:
        stream.close()
        bar.close()
        tally.captured_during_run = _captures(pipe) - captures_at_start
        pipe.close()
    seconds = time.monotonic() - start
    if not args.quiet:
        _summary(tally, seconds, sink, args, state)
    if stopped:
        print("mmpipe caption: stopped at the first failure (--fail-fast)", file=sys.stderr)
    else:
        # The commit (an --append/--overwrite run's journal removed, its partial records merged)
        # comes last, after the summary: a run killed before it, even after its summary, resumes
        # when started again instead of appending twice; the command exits right after it
        # (`mmpipe.cli.exit_now`), so no teardown window follows the commit.
        sys.stderr.flush()
        sink.finish()
    return 1 if tally.failed or tally.unmatched_inputs else 0


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Pipeline settings the command's flags give, for the local run and the Ray job alike."""
    options: dict[str, Any] = {"preprocess_workers": args.workers, "image_decode": "gpu" if args.gpu_decode else "cpu"}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.tp > 1:
        options["tensor_parallel_size"] = args.tp
    if args.vit_parallel:
        options["vit_parallel"] = args.vit_parallel
    if args.batch_size:
        options["max_running_requests"] = args.batch_size
    for name in ("min_pixels", "max_pixels"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.vit_graphs is not None:
        from mmpipe import EngineConfig

        options["vit_graph"] = dataclasses.replace(EngineConfig().vit_graph, enabled=args.vit_graphs)
    return options


def _captures(pipe: Any) -> int:
    stats = pipe.stats()
    return sum(stats[name]["captures"] for name in ("vit", "prefill", "decode"))


def _report(item: ImageItem, reason: str, errors: ErrorLog, bar: Any) -> None:
    from mmpipe.pipeline import per_file_error

    reason = per_file_error(reason)  # the line names the file
    line = f"failed {item.path}: {reason}"
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr)
    errors.add(item, reason)


def _summary(tally: Tally, seconds: float, sink: Sink, args: argparse.Namespace, state: Any) -> None:
    who = f"rank {state.process_index}: " if state.num_processes > 1 else ""
    parts = [f"{who}captioned {tally.captioned} image(s)"]
    if seconds > 0:
        parts[0] += (f" in {seconds:.1f} s ({tally.captioned / seconds:.1f} images/s, "
                     f"{tally.tokens / seconds:.0f} generated tokens/s)")
    if tally.already:
        parts.append(f"{tally.already} already captioned")
    parts.append(f"{tally.failed} failed")
    if tally.captured_during_run:
        parts.append(f"{tally.captured_during_run} graph(s) captured during the run")
    if tally.unmatched_inputs:
        parts.append(f"{tally.unmatched_inputs} input(s) matched no image")
    where = f"; outputs: {sink.where}" if not isinstance(sink, StdoutSink) else ""
    errs = f"; errors: {args.errors_file}" if args.errors_file and tally.failed else ""
    print(", ".join(parts) + where + errs, file=sys.stderr)


# ---------------------------------------------------------------------- several processes


@dataclasses.dataclass(frozen=True)
class SingleProcess:
    """The process state of a run that no launcher started: the one process is rank 0 of 1."""

    num_processes: int = 1
    process_index: int = 0
    local_process_index: int = 0
    is_main_process: bool = True

    def wait_for_everyone(self) -> None:
        pass


# What `accelerate launch`, `torchrun` and MPI launchers set (accelerate's PartialState reads these)
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_PROCESS_INDEX", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                       "MV2_COMM_WORLD_SIZE")


def under_launcher(environ: Any = os.environ) -> bool:
    """Whether a launcher started this process: any variable one sets is present."""
    return any(str(environ.get(name, "")).strip() for name in _LAUNCHER_VARIABLES)


def _process_state(cpu: bool) -> Any:
    """Rank and world size: under a launcher, accelerate's (`accelerate launch`, `torchrun`,
    MPI; without CUDA, or with --device cpu, the processes meet over gloo on the CPU); without
    one, a single process, and accelerate is not imported (~0.15 s of start-up, boto3 among it)."""
    if not under_launcher():
        return SingleProcess()
    import torch
    from accelerate import PartialState

    return PartialState(cpu=cpu or not torch.cuda.is_available())


def replica_device(local_index: int, tp: int) -> str:
    """The first GPU of a data-parallel replica: replica i of T GPUs each holds GPUs iT .. iT+T-1."""
    return f"cuda:{local_index * tp}"


def _launch_processes(count: int, gpus: int) -> int:
    """`--gpus N`: the same command again under `accelerate launch` with `count` processes (N, or
    N / T replicas of T GPUs with --tp T)."""
    argv = [a for a in _strip_gpus(sys.argv[1:])]
    if argv[:1] == ["caption"]:  # started as `mmpipe caption ...`
        argv = argv[1:]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(count),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"mmpipe caption: --gpus {gpus} but this machine has {have} CUDA GPU(s)", file=sys.stderr)
        return 2
    command += ["--multi_gpu", "-m", "mmpipe.app.caption", *argv]
    with tempfile.TemporaryDirectory(prefix="mmpipe-caption-shards-") as status:
        code = subprocess.call(command, env={**os.environ, SHARD_STATUS_ENV: status})
        return report_unfinished_shards(status, count, code)


# Where each process of a several-process run marks its shard captioned (set by `--gpus N`;
# read through `mmpipe.settings`).
SHARD_STATUS_ENV = "MMPIPE_CAPTION_SHARD_STATUS"


def mark_shard_captioned(rank: int) -> None:
    """This process's shard is captioned and its outputs written (the merge may still follow)."""
    from mmpipe import settings

    folder = settings.current().caption_shard_status
    if folder:
        with open(os.path.join(folder, f"shard{rank}.captioned"), "w"):
            pass


def report_unfinished_shards(folder: str, count: int, code: int) -> int:
    """After a several-process run: one line naming the shards whose process did not finish
    captioning (killed, crashed), and a non-zero exit code then. What they wrote is kept; the
    same command again captions only the images still missing."""
    done = {name for name in os.listdir(folder) if name.endswith(".captioned")}
    missing = [rank for rank in range(count) if f"shard{rank}.captioned" not in done]
    if missing:
        print(f"mmpipe caption: shard(s) {', '.join(map(str, missing))} of {count} did not finish (a process died, "
              f"exit code {code}); the captions written are kept; run the same command again to caption the rest",
              file=sys.stderr)
        return code or 1
    return code


def _strip_gpus(argv: Sequence[str]) -> Iterator[str]:
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--gpus":
            skip = True
            continue
        if arg.startswith("--gpus="):
            continue
        yield arg


def _merge_parts(args: argparse.Namespace, items: list[ImageItem], world: int) -> None:
    """The first process folds every process's record-file and errors-file parts into the outputs."""
    from mmpipe.app.caption_io import merge_record_parts

    if args.format in FORMATS:
        paths = {args.output} if args.output else {os.path.join(i.root, "metadata.jsonl") for i in items}
        for path in sorted(paths):
            merge_record_parts(path, FORMATS[args.format], [f"{path}.part{r}of{world}" for r in range(world)])
    if args.errors_file:
        with open(args.errors_file, "w", encoding="utf-8") as out:
            for r in range(world):
                part = f"{args.errors_file}.part{r}of{world}"
                if os.path.exists(part):
                    with open(part, encoding="utf-8") as handle:
                        out.write(handle.read())
                    os.remove(part)


def main(argv: Sequence[str] | None = None) -> int:
    from mmpipe.cli import guarded

    return guarded("mmpipe caption", lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
