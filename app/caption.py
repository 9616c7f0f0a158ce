"""Batch captioning of images and video clips: files, directories or globs in; one caption per file
out (a video file, known by its extension, is captioned as a video).

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
the same command captions every image exactly once (see `caption_sinks`, `caption_records`).
An unreadable image is reported once on stderr (and in `--errors-file`) and skipped; the exit
code is 1 if any image or input failed, 2 for a usage error.

The command line is `caption_args`, the inputs `caption_inputs`, what the run reports
`caption_report`, and several processes `caption_processes`.

Several processes (`--gpus N`, `accelerate launch -m mmpipe.app.caption ...` or `torchrun`)
each caption a deterministic shard of the sorted images with their own Pipeline; sidecars need
no merge, record files are written per process and merged by the first process at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Sequence

from mmpipe.app import caption_processes as processes
from mmpipe.app.caption_args import build_parser, check_args, engine_options, sampling_params, video_options
from mmpipe.app.caption_files import remove_stale_temporaries, unwritable
from mmpipe.app.caption_inputs import ImageItem, PromptResolver, collect_images, read_prompt_file, shard
from mmpipe.app.caption_records import FORMATS
from mmpipe.app.caption_report import ErrorLog, Tally, report_failure, summary
from mmpipe.app.caption_sinks import RecordSink, SidecarSink, Sink, StdoutSink
from mmpipe.errors import InputError

WARM_UP_SAMPLE = 4  # files whose sizes decide the ViT graphs captured before the run


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
    if replicas > 1 and not processes.under_launcher():
        return processes.launch_processes(replicas, args.gpus)
    try:
        check_args(args)
        prompt = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
        sampling = sampling_params(args)
        video = video_options(args)
    except (InputError, ValueError) as exc:
        print(f"mmpipe caption: {exc}", file=sys.stderr)
        return 2
    if args.format == "parquet" and not args.ray:
        print("mmpipe caption: --format parquet is for --ray (a directory of Parquet files)", file=sys.stderr)
        return 2
    # The Ray driver never touches a GPU (no accelerate state): its actors have them.
    state = None if args.ray else processes.process_state(cpu=args.device == "cpu")
    items, problems = collect_images(args.images)
    if state is None or state.is_main_process:
        for problem in problems:
            print(f"mmpipe caption: {problem}", file=sys.stderr)
    if not items:
        print("mmpipe caption: no images or videos to caption", file=sys.stderr)
        return 2
    if state is None:
        from mmpipe.app.caption_ray import run_ray

        return run_ray(args, [item.path for item in items], prompt, sampling, video)
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
        code = _caption(args, state, mine, prompt, sampling, video, sink, errors, tally)
        if world > 1:
            processes.mark_shard_captioned(rank)
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
            processes.merge_parts(args, items, world)
    return code


def _caption(args: argparse.Namespace, state: Any, items: list[ImageItem], prompt: str | None, sampling: Any,
             video: Any, sink: Sink, errors: ErrorLog, tally: Tally) -> int:
    from tqdm import tqdm

    from mmpipe import Pipeline
    from mmpipe.captioning import (
        DEFAULT_CAPTION_PROMPT,
        DEFAULT_VIDEO_PROMPT,
        caption_conversation,
        caption_result,
    )
    from mmpipe.errors import MmpipeError

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
            report_failure(item, message, errors, None)
            tally.failed += 1
        clashing = {item.key for item, _ in clashes}
        items = [i for i in items if i.key not in clashing]
    todo = [i for i in items if not sink.done(i)]
    tally.already = len(items) - len(todo)
    resolve = PromptResolver(prompt or DEFAULT_CAPTION_PROMPT, args.dir_prompts,
                             args.video_prompt or prompt or DEFAULT_VIDEO_PROMPT)
    options = {**engine_options(args), "startup_progress": not args.quiet}
    if not todo:
        sink.finish()
        if not args.quiet:
            summary(tally, 0.0, sink, args, state)
        return 1 if tally.failed or tally.unmatched_inputs else 0
    device = args.device if args.device or state.num_processes == 1 else processes.replica_device(
        state.local_process_index, args.tp)
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
    # Videos are left out: warm_up takes images, and a clip would be decoded twice.
    pipe.warm_up([item.path for item in todo if not item.is_video][:WARM_UP_SAMPLE], sampling)
    captures_at_start = _captures(pipe)
    start = time.monotonic()
    bar = tqdm(total=len(todo), unit="file" if any(i.is_video for i in todo) else "img", disable=args.quiet or not todo, file=sys.stderr, dynamic_ncols=True,
               position=state.process_index, desc=f"rank {state.process_index}" if state.num_processes > 1 else None)
    stopped = False
    conversations = (caption_conversation(item.path, resolve(item), video) for item in todo)
    stream = pipe.chat_stream(conversations, sampling)
    try:
        for output in stream:
            item = todo[output.index]
            bar.update(1)
            tally.tokens += len(output.token_ids)
            text, reason = caption_result(output)
            if reason is None and args.json_schema is not None and output.finish_reason != "stop":
                reason = (f"its JSON was cut off after {len(output.token_ids)} tokens (--max-new-tokens): "
                          "raise it, or bound the schema's strings and arrays")
            if reason is not None:
                tally.failed += 1
                report_failure(item, reason, errors, bar)
                if args.fail_fast:
                    stopped = True
                    break
                continue
            if isinstance(sink, StdoutSink):
                bar.clear()
            sink.write(item, f"{args.prefix}{text}{args.suffix}")
            tally.captioned += 1
            tally.videos += item.is_video
    finally:
        stream.close()
        bar.close()
        tally.captured_during_run = _captures(pipe) - captures_at_start
        pipe.close()
    seconds = time.monotonic() - start
    if not args.quiet:
        summary(tally, seconds, sink, args, state)
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


def _captures(pipe: Any) -> int:
    stats = pipe.stats()
    return sum(stats[name]["captures"] for name in ("vit", "prefill", "decode"))


def main(argv: Sequence[str] | None = None) -> int:
    from mmpipe.cli import guarded

    return guarded("mmpipe caption", lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
