"""Batch image captioning: files, directories or globs in; one caption per image out.

    python -m mmpipe.app.caption assets/images                       # print "path<TAB>caption"
    python -m mmpipe.app.caption photos/ --output captions.jsonl     # JSON lines; re-running resumes

Images are processed in batches; an image that cannot be read is reported on stderr and
skipped, and every other image is still captioned. With --output, finished captions are
appended as they complete and images already in the file are skipped, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import time
from typing import Iterable, Iterator, Sequence

from mmpipe.config import GraphMode

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


def find_images(inputs: Iterable[str]) -> list[str]:
    """Expand directories (recursively, image suffixes only) and globs; keep explicit files as given."""
    found: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            for root, _, files in sorted(os.walk(item)):
                found += [os.path.join(root, f) for f in sorted(files) if os.path.splitext(f)[1].lower() in IMAGE_SUFFIXES]
        elif any(ch in item for ch in "*?["):
            found += sorted(glob.glob(item, recursive=True))
        else:
            found.append(item)
    return found


def _batches(items: Sequence[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


def _done_paths(output: str) -> set[str]:
    done: set[str] = set()
    if not os.path.isfile(output):
        return done
    with open(output) as handle:
        for line in handle:
            try:
                done.add(json.loads(line)["image"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by an interruption
    return done


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="mmpipe caption", description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="image files, directories or glob patterns")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--prompt", default=None, help="instruction (default: 'Describe this image.')")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64, help="images per engine call")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)")
    parser.add_argument("--output", default=None, help="write JSON lines here (appends; resumes)")
    parser.add_argument("--vit-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="CUDA graphs for the vision encoder (default: on with CUDA)")
    parser.add_argument("--graph-mode", default=None, choices=[m.value for m in GraphMode],
                        help="CUDA graphs for the language model (default: full_and_piecewise on CUDA)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from mmpipe import Pipeline, SamplingParams
    from mmpipe.pipeline import caption_conversation

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    paths = find_images(args.images)
    if not paths:
        print("no images found", file=sys.stderr)
        return 2
    done = _done_paths(args.output) if args.output else set()
    todo = [p for p in paths if p not in done]
    import dataclasses

    from mmpipe import EngineConfig

    options = {} if args.vit_graphs is None else {
        "vit_graph": dataclasses.replace(EngineConfig().vit_graph, enabled=args.vit_graphs)}
    pipe = Pipeline.from_pretrained(args.model, device=args.device, dtype=args.dtype, graph_mode=args.graph_mode,
                                    **options)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    sink = open(args.output, "a") if args.output else None
    failed = captioned = 0
    start = time.monotonic()
    bar = tqdm(total=len(todo), unit="img", disable=args.quiet or len(todo) < 2, file=sys.stderr)
    try:
        for batch in _batches(todo, args.batch_size):
            outputs = pipe.chat([caption_conversation(path, args.prompt) for path in batch], sampling,
                                errors="return")
            for path, output in zip(batch, outputs):
                if not output.ok:
                    failed += 1
                    bar.clear()
                    print(f"skipped {path}: {output.error}", file=sys.stderr, flush=True)
                    continue
                captioned += 1
                caption = output.text.strip()
                if sink:
                    sink.write(json.dumps({"image": path, "caption": caption}) + "\n")
                else:
                    bar.clear()
                    print(f"{path}\t{caption}", flush=True)
            if sink:
                sink.flush()
            bar.update(len(batch))
    finally:
        bar.close()
        if sink:
            sink.close()
    seconds = time.monotonic() - start
    already = len(done & set(paths))
    skipped = f", {already} already done" if already else ""
    print(f"captioned {captioned} image(s) in {seconds:.1f} s, {failed} failed{skipped}", file=sys.stderr)
    # Unreadable images are reported and skipped; the run fails only if nothing could be captioned.
    return 1 if failed and not (captioned or already) else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
