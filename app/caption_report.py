"""What a `mmpipe caption` run tells its user: a line on stderr for each file that failed (and a
JSON line in `--errors-file`), and the closing summary of what was captioned, skipped and failed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from mmpipe.app.caption_inputs import ImageItem
from mmpipe.app.caption_sinks import Sink, StdoutSink


@dataclasses.dataclass
class Tally:
    """What a run counted, for its summary and its exit code."""

    captioned: int = 0
    videos: int = 0  # of the captioned, the videos
    already: int = 0
    failed: int = 0
    unmatched_inputs: int = 0
    tokens: int = 0
    captured_during_run: int = 0  # graphs captured after the run started (the start-up missed them)


class ErrorLog:
    """`--errors-file`: one JSON line (image, error) per file that failed in this run (`image`
    holds a video's path too, as the record files do)."""

    def __init__(self, path: str | None) -> None:
        if path:  # its folder is made as the outputs' are (`unwritable` checked it can be)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._handle = open(path, "w", encoding="utf-8") if path else None

    def add(self, item: ImageItem | str, error: str) -> None:
        if self._handle is not None:
            image = item.path if isinstance(item, ImageItem) else item
            self._handle.write(json.dumps({"image": image, "error": error}, ensure_ascii=False) + "\n")
            self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


def report_failure(item: ImageItem, reason: str, errors: ErrorLog, bar: Any) -> None:
    """One failed file: a line on stderr (above the progress bar) and one in the errors file."""
    from mmpipe.captioning import per_file_error

    reason = per_file_error(reason)  # the line names the file
    if item.is_video and "(max_model_len)" in reason:
        reason += " (sample fewer or smaller frames: --fps, --max-frames, --video-total-pixels)"
    line = f"failed {item.path}: {reason}"
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr)
    errors.add(item, reason)


def summary(tally: Tally, seconds: float, sink: Sink, args: argparse.Namespace, state: Any) -> None:
    who = f"rank {state.process_index}: " if state.num_processes > 1 else ""
    if tally.videos:
        parts = [f"{who}captioned {tally.captioned - tally.videos} image(s) and {tally.videos} video(s)"]
    else:
        parts = [f"{who}captioned {tally.captioned} image(s)"]
    if seconds > 0:
        parts[0] += (f" in {seconds:.1f} s ({tally.captioned / seconds:.1f} {'files' if tally.videos else 'images'}/s, "
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
