"""File operations that keep `mmpipe caption`'s outputs whole when a run is killed at any moment:
whole-or-nothing writes (a temporary file renamed), removal of the temporaries a killed run left,
repair of a last line a killed run left torn, and the check, before the model loads, that every
output can be written."""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Any, Iterable

TMP_MARK = ".mmpipe-tmp"


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


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_text(path: str) -> str | None:
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
