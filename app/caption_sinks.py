"""Where `mmpipe caption` puts each caption: stdout, a sidecar `name.txt` beside each image (or
mirrored under an output directory), or record files. A sidecar is written to a temporary file
and renamed, so it is whole or absent; overwriting or appending to sidecars goes through a
journal, so a killed run, started again, neither loses nor repeats an image.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mmpipe.app.caption_files import atomic_write, read_text, repair_torn_tail, sha
from mmpipe.app.caption_inputs import ImageItem
from mmpipe.app.caption_records import FORMATS, RecordFile, read_records


class Sink:
    """Where captions go. `done(item)`: already captioned as this run's policy counts it;
    `write(item, caption)`: durable when it returns; `finish()`: the run completed."""

    where = ""

    def done(self, item: ImageItem) -> bool:
        return False

    def write(self, item: ImageItem, caption: str) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class StdoutSink(Sink):
    where = "stdout"

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, item: ImageItem, caption: str) -> None:
        shown = os.path.relpath(item.path)
        self.stream.write(f"{item.path if shown.startswith('..') else shown}\t{caption}\n")
        self.stream.flush()


class SidecarSink(Sink):
    """`name.txt` beside each image, or mirrored under `output_dir`.

    skip: an existing sidecar is a finished caption. overwrite / append: a journal in each
    root remembers which sidecars this run already rewrote (with a hash of what it wrote), so a
    killed run, started again, does not append twice; the journal goes when the run completes.
    """

    def __init__(self, policy: str, output_dir: str | None, separator: str, run_id: str) -> None:
        self.policy, self.output_dir, self.separator = policy, output_dir, separator
        self.where = f"sidecar .txt files {'under ' + output_dir if output_dir else 'beside the images'}"
        self._journal_name = f".mmpipe-caption-{run_id}.journal"
        self._journals: dict[str, dict[str, str]] = {}
        self._handles: dict[str, Any] = {}

    def target(self, item: ImageItem) -> str:
        if self.output_dir:
            return os.path.splitext(os.path.join(self.output_dir, item.rel))[0] + ".txt"
        return os.path.splitext(item.path)[0] + ".txt"

    def done(self, item: ImageItem) -> bool:
        target = self.target(item)
        if self.policy == "skip":
            return os.path.exists(target)
        wrote = self._journal(item.root).get(item.key)
        return wrote is not None and sha(read_text(target) or "") == wrote

    def write(self, item: ImageItem, caption: str) -> None:
        target = self.target(item)
        text = caption
        if self.policy == "append":
            old = read_text(target)
            if old:
                text = old.rstrip("\n") + self.separator + caption
        if self.policy != "skip":  # journal first: a kill after it but before the rename redoes this one
            self._log(item, text)
        atomic_write(target, text)

    def _journal_path(self, root: str) -> str:
        return os.path.join(self.output_dir or root, self._journal_name)

    def _journal(self, root: str) -> dict[str, str]:
        if root not in self._journals:
            path = self._journal_path(root)
            repair_torn_tail(path, lambda line: _json_ok(line))
            entries: dict[str, str] = {}
            for line in (read_text(path) or "").splitlines():
                if _json_ok(line):
                    record = json.loads(line)
                    entries[record["key"]] = record["sha"]
            self._journals[root] = entries
        return self._journals[root]

    def _log(self, item: ImageItem, text: str) -> None:
        self._journal(item.root)[item.key] = sha(text)
        path = self._journal_path(item.root)
        if path not in self._handles:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._handles[path] = open(path, "a", encoding="utf-8")
        handle = self._handles[path]
        handle.write(json.dumps({"key": item.key, "sha": sha(text)}) + "\n")
        handle.flush()

    def finish(self) -> None:
        self.close()
        for root in self._journals:
            try:
                os.remove(self._journal_path(root))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def _json_ok(line: str) -> bool:
    try:
        record = json.loads(line)
        return isinstance(record, dict) and "key" in record and "sha" in record
    except ValueError:
        return False


class RecordSink(Sink):
    """Record files: one given file, or (metadata without --output) one metadata.jsonl per root.
    With `part` (one of several processes) records go to `<file><part>`, and images already in
    the file itself count as done too."""

    def __init__(self, fmt_name: str, policy: str, output: str | None, separator: str, part: str = "") -> None:
        self.fmt_name, self.policy, self.separator, self.part = fmt_name, policy, separator, part
        self.output = output[: len(output) - len(part)] if output and part else output
        self.files: dict[str, RecordFile] = {}
        self._merged: dict[str, dict[str, str]] = {}
        self.where = self.output or "metadata.jsonl in each dataset folder"

    def file_for(self, item: ImageItem) -> RecordFile:
        path = self.output or os.path.join(item.root, "metadata.jsonl")
        if path not in self.files:
            fmt = FORMATS[self.fmt_name](os.path.dirname(os.path.abspath(path)))
            self.files[path] = RecordFile(path + self.part, fmt, self.policy, self.separator)
            self._merged[path] = read_records(path, fmt) if self.part else {}
        return self.files[path]

    def done(self, item: ImageItem) -> bool:
        f = self.file_for(item)
        return f.done(item) or item.key in self._merged[self.output or os.path.join(item.root, "metadata.jsonl")]

    def write(self, item: ImageItem, caption: str) -> None:
        self.file_for(item).write(item, caption)

    def finish(self) -> None:
        for f in self.files.values():
            f.finish()

    def close(self) -> None:
        for f in self.files.values():
            f.close()
