"""What `mmpipe caption` reads and writes: the images behind its inputs, their prompts, and the
caption outputs, each written so that a run killed at any moment resumes exactly.

Images are known by one canonical key (the absolute path with symlinks resolved), so `imgs`,
`./imgs` and `imgs/*.png` name the same files and resume finds them whatever was typed.

Outputs:
- `SidecarSink`: `name.txt` beside each image (or mirrored under an output directory), written
  to a temporary file and renamed, so a sidecar is whole or absent.
- `RecordFile` (jsonl, metadata.jsonl, csv): one record per image, appended and flushed as each
  caption completes. A torn last line (a run killed mid-write) is cut off when the file is opened
  again; an image already recorded is never written twice.
- Overwriting or appending to existing captions goes through a journal (sidecars) or a partial
  file merged at the end (record files), so a killed run, started again, neither loses nor
  repeats an image.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
DIR_PROMPT_FILE = "prompt.txt"
TMP_MARK = ".mmpipe-tmp"


@dataclass(frozen=True)
class ImageItem:
    path: str  # absolute, as found (a symlink stays a symlink: its sidecar goes beside it)
    key: str  # canonical: symlinks resolved; identifies the image in every output
    root: str  # the dataset root it was found under (an input directory, or a file's folder)
    rel: str  # path relative to root, '/'-separated

    @classmethod
    def make(cls, path: str, root: str) -> "ImageItem":
        path, root = os.path.abspath(path), os.path.abspath(root)
        return cls(path, os.path.realpath(path), root, os.path.relpath(path, root).replace(os.sep, "/"))


# ---------------------------------------------------------------------- inputs


def collect_images(inputs: Iterable[str]) -> tuple[list[ImageItem], list[str]]:
    """Expand files, directories (recursively; hidden entries skipped) and globs into images,
    each once (first input wins). Returns the images and one message per input that yields
    nothing, so no input vanishes silently."""
    items: list[ImageItem] = []
    seen: set[str] = set()
    problems: list[str] = []
    for raw in inputs:
        found, problem = _expand(raw)
        if problem:
            problems.append(f"{raw}: {problem}")
        for item in found:
            if item.key not in seen:
                seen.add(item.key)
                items.append(item)
    return items, problems


def _expand(raw: str) -> tuple[list[ImageItem], str | None]:
    if os.path.isdir(raw):
        found = list(_walk(raw))
        return found, None if found else f"directory has no images ({', '.join(sorted(IMAGE_SUFFIXES))})"
    if os.path.isfile(raw):
        return [ImageItem.make(raw, os.path.dirname(raw) or ".")], None  # given by name: always tried
    if glob.has_magic(raw):
        matches = sorted(glob.glob(raw, recursive=True))
        base = _glob_base(raw)
        found: list[ImageItem] = []
        for match in matches:
            if os.path.isdir(match):
                found += _walk(match)
            elif _is_image_name(match):
                found.append(ImageItem.make(match, base))
        if found:
            return found, None
        return [], "matches nothing" if not matches else f"matches {len(matches)} path(s) but no image"
    if os.path.lexists(raw):
        return [], "not a file or a directory"
    return [], "no such file or directory"


def _walk(root: str) -> Iterator[ImageItem]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and _is_image_name(name):
                yield ImageItem.make(os.path.join(folder, name), root)


def _is_image_name(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_SUFFIXES


def _glob_base(pattern: str) -> str:
    """The folder a glob's matches are relative to: its path up to the first wildcard."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or ("/" if pattern.startswith("/") else ".")


def shard(items: list[ImageItem], rank: int, world: int) -> list[ImageItem]:
    """Rank r's deterministic share of the images: every world-th of them sorted by key."""
    return sorted(items, key=lambda i: i.key)[rank::world]


# ---------------------------------------------------------------------- prompts


class PromptResolver:
    """The prompt of each image: the nearest `prompt.txt` in its folder or an ancestor up to its
    dataset root when `per_directory`, else the global one."""

    def __init__(self, default: str, per_directory: bool) -> None:
        self.default = default
        self.per_directory = per_directory
        self._cache: dict[str, str | None] = {}

    def __call__(self, item: ImageItem) -> str:
        if not self.per_directory:
            return self.default
        folder = os.path.dirname(item.path)
        while True:
            found = self._read(folder)
            if found is not None:
                return found
            if folder == item.root or os.path.dirname(folder) == folder:
                return self.default
            folder = os.path.dirname(folder)

    def _read(self, folder: str) -> str | None:
        if folder not in self._cache:
            path = os.path.join(folder, DIR_PROMPT_FILE)
            text = read_prompt_file(path) if os.path.isfile(path) else None
            self._cache[folder] = text
        return self._cache[folder]


def read_prompt_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"prompt file {path}: {exc}") from None
    if not text:
        raise ValueError(f"prompt file {path} is empty")
    return text


# ---------------------------------------------------------------------- small file helpers


def atomic_write(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all (temporary file in the same folder + rename)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}{TMP_MARK}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def remove_stale_temporaries(folders: Iterable[str]) -> None:
    """Temporary files a killed run left behind (they never hold a finished caption)."""
    for folder in set(folders):
        for path in glob.glob(os.path.join(glob.escape(folder), f".*{TMP_MARK}")):
            try:
                os.remove(path)
            except OSError:
                pass


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def repair_torn_tail(path: str, complete: Any) -> int:
    """Cut a last line that a killed run left unterminated or unparsable; returns bytes cut.
    `complete(line) -> bool` says whether a newline-terminated line is a whole record."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb+") as handle:
        data = handle.read()
        keep = len(data)
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
        elif data:
            start = data.rfind(b"\n", 0, len(data) - 1) + 1
            if not complete(data[start:].decode("utf-8", "replace")):
                keep = start
        if keep < len(data):
            handle.truncate(keep)
        return len(data) - keep


# ---------------------------------------------------------------------- record formats


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
    name = "jsonl"

    def encode(self, item: ImageItem, caption: str) -> str:
        return json.dumps({"image": item.path, "caption": caption}, ensure_ascii=False) + "\n"

    def decode(self, line: str) -> tuple[str, str] | None:
        try:
            record = json.loads(line)
            return self._key(record["image"]), str(record["caption"])
        except (ValueError, KeyError, TypeError):
            return None


class MetadataFormat(RecordFormat):
    """Hugging Face `imagefolder`'s metadata.jsonl: `file_name` relative to the file's folder."""

    name = "metadata"

    def encode(self, item: ImageItem, caption: str) -> str:
        rel = os.path.relpath(item.path, self.folder).replace(os.sep, "/")
        return json.dumps({"file_name": rel, "text": caption}, ensure_ascii=False) + "\n"

    def decode(self, line: str) -> tuple[str, str] | None:
        try:
            record = json.loads(line)
            return self._key(record["file_name"]), str(record["text"])
        except (ValueError, KeyError, TypeError):
            return None


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


def _read_records(path: str, fmt: RecordFormat) -> dict[str, str]:
    records: dict[str, str] = {}
    text = _read_text(path) or ""
    for line in _logical_lines(text, fmt):
        decoded = fmt.decode(line)
        if decoded is not None:
            records[decoded[0]] = decoded[1]
    return records


def _logical_lines(text: str, fmt: RecordFormat) -> list[str]:
    """Records, one per line (CSV captions are kept to one line by `CsvFormat.encode`)."""
    return text.splitlines(keepends=True)


# ---------------------------------------------------------------------- sinks


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
        return wrote is not None and _sha(_read_text(target) or "") == wrote

    def write(self, item: ImageItem, caption: str) -> None:
        target = self.target(item)
        text = caption
        if self.policy == "append":
            old = _read_text(target)
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
            for line in (_read_text(path) or "").splitlines():
                if _json_ok(line):
                    record = json.loads(line)
                    entries[record["key"]] = record["sha"]
            self._journals[root] = entries
        return self._journals[root]

    def _log(self, item: ImageItem, text: str) -> None:
        self._journal(item.root)[item.key] = _sha(text)
        path = self._journal_path(item.root)
        if path not in self._handles:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._handles[path] = open(path, "a", encoding="utf-8")
        handle = self._handles[path]
        handle.write(json.dumps({"key": item.key, "sha": _sha(text)}) + "\n")
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
            self.records = _read_records(path, fmt)
            self._writing = path
        else:
            self._partial = path + ".partial"
            repair_torn_tail(self._partial, lambda line: complete(line) or line.startswith("#mmpipe-base "))
            self._finish_interrupted_merge()
            base = _read_text(self._partial)
            if base is None:
                atomic_write(self._partial, f"#mmpipe-base {_sha(_read_text(path) or '')}\n")
            self.records = _read_records(self._partial, fmt)
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
        text = _read_text(self._partial)
        if text and text.startswith("#mmpipe-base "):
            base = text.split("\n", 1)[0].split(" ", 1)[1]
            if base != _sha(_read_text(self.path) or ""):
                os.remove(self._partial)

    def finish(self) -> None:
        self.close()
        if self.policy == "skip":
            return
        new = _read_records(self._partial, self.fmt)
        old_text = _read_text(self.path) or ""
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
        for line in _logical_lines(_read_text(self._partial) or "", self.fmt):
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
        record["text" if isinstance(self.fmt, MetadataFormat) else "caption"] = caption
        return json.dumps(record, ensure_ascii=False) + "\n"

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()


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
            self._merged[path] = _read_records(path, fmt) if self.part else {}
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


def merge_record_parts(path: str, fmt_cls: type[RecordFormat], parts: list[str]) -> None:
    """Fold per-process part files into `path` (each image once), then remove the parts. Safe
    to repeat after a kill: records already in `path` are not added again."""
    fmt = fmt_cls(os.path.dirname(os.path.abspath(path)))
    complete = lambda line: fmt.decode(line) is not None or (fmt.header is not None and line == fmt.header)  # noqa: E731
    existing = [p for p in parts if os.path.exists(p)]
    if not existing:
        return
    repair_torn_tail(path, complete)
    text = _read_text(path) or ""
    if not text and fmt.header:
        text = fmt.header
    seen = set(_read_records(path, fmt))
    added = []
    for part in existing:
        repair_torn_tail(part, complete)
        for line in _logical_lines(_read_text(part) or "", fmt):
            decoded = fmt.decode(line)
            if decoded is not None and decoded[0] not in seen:
                seen.add(decoded[0])
                added.append(line)
    atomic_write(path, text + "".join(added))
    for part in existing:
        os.remove(part)


def unwritable(paths: Iterable[str]) -> str | None:
    """The first of these output files that cannot be written, with the reason, or None. Checked
    before the model loads, so an unwritable place costs no captioning work: each distinct folder
    (or, where it does not exist yet, the nearest existing folder above it, where the writers will
    create it) gets a probe file created and removed (the one test that holds for read-only file
    systems, permissions and root alike); an existing file is opened for appending (its contents
    untouched)."""
    import tempfile

    folders: dict[str, str] = {}
    for path in paths:
        if os.path.exists(path):
            try:
                with open(path, "ab"):
                    pass
            except OSError as exc:
                return f"{path}: cannot write it ({exc.strerror or exc})"
        folders.setdefault(os.path.dirname(os.path.abspath(path)), path)
    for folder, path in folders.items():
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            return f"{path}: cannot make its folder ({folder} is a file)"
        try:
            handle, probe = tempfile.mkstemp(prefix=".mmpipe-write-test-", dir=folder)
            os.close(handle)
            os.remove(probe)
        except OSError as exc:
            return f"{path}: cannot write in {folder} ({exc.strerror or exc})"
    return None


class ErrorLog:
    """`--errors-file`: one JSON line (image, error) per image that failed in this run."""

    def __init__(self, path: str | None) -> None:
        self._handle = open(path, "w", encoding="utf-8") if path else None

    def add(self, item: ImageItem | str, error: str) -> None:
        if self._handle is not None:
            image = item.path if isinstance(item, ImageItem) else item
            self._handle.write(json.dumps({"image": image, "error": error}, ensure_ascii=False) + "\n")
            self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
