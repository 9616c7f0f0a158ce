"""`mmpipe caption`'s record files (jsonl, metadata.jsonl, csv): one record per image, appended and
flushed as each caption completes. A torn last line (a run killed mid-write) is cut off when the
file is opened again; an image already recorded is never written twice. Overwriting or appending
goes through a partial file merged at the end, and the parts of several processes are folded into
one file, each safe to repeat after a kill.
"""

from __future__ import annotations

import csv
import io
import json
import os

from mmpipe.app.caption_files import atomic_write, read_text, repair_torn_tail, sha
from mmpipe.app.caption_inputs import ImageItem


class RecordFormat:
    """How one record file spells an image and its caption."""

    name = ""
    header: str | None = None

    def __init__(self, folder: str) -> None:
        self.folder = folder  # relative paths in records are relative to the file's folder

    def encode(self, item: ImageItem, caption: str) -> str:
        raise NotImplementedError

    def decode(self, line: str) -> tuple[str, str] | None:
        """(canonical key, caption) of a whole line, or None."""
        raise NotImplementedError

    def _key(self, path: str) -> str:
        return os.path.realpath(os.path.join(self.folder, path))


class JsonlFormat(RecordFormat):
    """One JSON object per line: the image's path and its caption, under these fields."""

    name = "jsonl"
    path_field, text_field = "image", "caption"

    def spelled(self, item: ImageItem) -> str:
        """How a record names the image."""
        return item.path

    def encode(self, item: ImageItem, caption: str) -> str:
        record = {self.path_field: self.spelled(item), self.text_field: caption}
        return json.dumps(record, ensure_ascii=False) + "\n"

    def decode(self, line: str) -> tuple[str, str] | None:
        try:
            record = json.loads(line)
            return self._key(record[self.path_field]), str(record[self.text_field])
        except (ValueError, KeyError, TypeError):
            return None


class MetadataFormat(JsonlFormat):
    """Hugging Face `imagefolder`'s metadata.jsonl: `file_name` relative to the file's folder."""

    name = "metadata"
    path_field, text_field = "file_name", "text"

    def spelled(self, item: ImageItem) -> str:
        return os.path.relpath(item.path, self.folder).replace(os.sep, "/")


class CsvFormat(RecordFormat):
    name = "csv"
    header = "image,caption\n"

    def encode(self, item: ImageItem, caption: str) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow([item.path, " ".join(caption.splitlines())])
        return out.getvalue()

    def decode(self, line: str) -> tuple[str, str] | None:
        rows = list(csv.reader(io.StringIO(line)))
        if len(rows) != 1 or len(rows[0]) != 2 or rows[0] == ["image", "caption"]:
            return None
        return self._key(rows[0][0]), rows[0][1]


FORMATS = {"jsonl": JsonlFormat, "metadata": MetadataFormat, "csv": CsvFormat}


def read_records(path: str, fmt: RecordFormat) -> dict[str, str]:
    records: dict[str, str] = {}
    text = read_text(path) or ""
    for line in _logical_lines(text, fmt):
        decoded = fmt.decode(line)
        if decoded is not None:
            records[decoded[0]] = decoded[1]
    return records


def _logical_lines(text: str, fmt: RecordFormat) -> list[str]:
    """Records, one per line (CSV captions are kept to one line by `CsvFormat.encode`)."""
    return text.splitlines(keepends=True)


class RecordFile:
    """One jsonl / metadata.jsonl / csv output file.

    skip: records are appended to the file itself. overwrite / append: new records go to
    `<file>.partial` first and are merged into the file at the end in one atomic replace (the
    partial file's first line holds a hash of the file it will merge into, so a merge already
    done is never done twice).
    """

    def __init__(self, path: str, fmt: RecordFormat, policy: str, separator: str) -> None:
        self.path, self.fmt, self.policy, self.separator = path, fmt, policy, separator
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        complete = lambda line: fmt.decode(line) is not None or (fmt.header is not None and line == fmt.header)  # noqa: E731
        if policy == "skip":
            repair_torn_tail(path, complete)
            self.records = read_records(path, fmt)
            self._writing = path
        else:
            self._partial = path + ".partial"
            repair_torn_tail(self._partial, lambda line: complete(line) or line.startswith("#mmpipe-base "))
            self._finish_interrupted_merge()
            base = read_text(self._partial)
            if base is None:
                atomic_write(self._partial, f"#mmpipe-base {sha(read_text(path) or '')}\n")
            self.records = read_records(self._partial, fmt)
            self._writing = self._partial
        fresh = not os.path.exists(self._writing) or os.path.getsize(self._writing) == 0
        self._handle = open(self._writing, "a", encoding="utf-8", newline="")
        if fresh and fmt.header and policy == "skip":
            self._handle.write(fmt.header)
            self._handle.flush()

    def done(self, item: ImageItem) -> bool:
        return item.key in self.records

    def write(self, item: ImageItem, caption: str) -> None:
        if item.key in self.records:  # never twice, whatever the caller does
            return
        self._handle.write(self.fmt.encode(item, caption))
        self._handle.flush()
        self.records[item.key] = caption

    def _finish_interrupted_merge(self) -> None:
        """A partial file whose base no longer matches the output was already merged: drop it."""
        text = read_text(self._partial)
        if text and text.startswith("#mmpipe-base "):
            base = text.split("\n", 1)[0].split(" ", 1)[1]
            if base != sha(read_text(self.path) or ""):
                os.remove(self._partial)

    def finish(self) -> None:
        self.close()
        if self.policy == "skip":
            return
        new = read_records(self._partial, self.fmt)
        old_text = read_text(self.path) or ""
        lines = []
        if self.fmt.header:
            lines.append(self.fmt.header)
        merged_keys = set()
        for line in _logical_lines(old_text, self.fmt):
            decoded = self.fmt.decode(line)
            if decoded is None:
                continue
            key, caption = decoded
            if key in new:
                merged_keys.add(key)
                if self.policy == "append":
                    caption = caption + self.separator + new[key]
                else:
                    caption = new[key]
                line = self._reencode(line, caption)
            lines.append(line)
        for line in _logical_lines(read_text(self._partial) or "", self.fmt):
            decoded = self.fmt.decode(line)
            if decoded is not None and decoded[0] not in merged_keys:
                lines.append(line)
        atomic_write(self.path, "".join(lines))
        os.remove(self._partial)

    def _reencode(self, line: str, caption: str) -> str:
        """The same record with another caption (keeps the file's own spelling of the path)."""
        if isinstance(self.fmt, CsvFormat):
            row = next(csv.reader(io.StringIO(line)))
            out = io.StringIO()
            csv.writer(out, lineterminator="\n").writerow([row[0], " ".join(caption.splitlines())])
            return out.getvalue()
        record = json.loads(line)
        record[self.fmt.text_field] = caption
        return json.dumps(record, ensure_ascii=False) + "\n"

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()


def merge_record_parts(path: str, fmt_cls: type[RecordFormat], parts: list[str]) -> None:
    """Fold per-process part files into `path` (each image once), then remove the parts. Safe
    to repeat after a kill: records already in `path` are not added again."""
    fmt = fmt_cls(os.path.dirname(os.path.abspath(path)))
    complete = lambda line: fmt.decode(line) is not None or (fmt.header is not None and line == fmt.header)  # noqa: E731
    existing = [p for p in parts if os.path.exists(p)]
    if not existing:
        return
    repair_torn_tail(path, complete)
    text = read_text(path) or ""
    if not text and fmt.header:
        text = fmt.header
    seen = set(read_records(path, fmt))
    added = []
    for part in existing:
        repair_torn_tail(part, complete)
        for line in _logical_lines(read_text(part) or "", fmt):
            decoded = fmt.decode(line)
            if decoded is not None and decoded[0] not in seen:
                seen.add(decoded[0])
                added.append(line)
    atomic_write(path, text + "".join(added))
    for part in existing:
        os.remove(part)
