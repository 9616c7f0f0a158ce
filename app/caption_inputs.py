"""What `mmpipe caption` reads: the images and video files behind its inputs (files, directories,
globs) and the prompt of each.

Files are known by one canonical key (the absolute path with symlinks resolved), so `imgs`,
`./imgs` and `imgs/*.png` name the same files and resume finds them whatever was typed. Several
processes each take a deterministic shard of them.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

from mmpipe.captioning import VIDEO_EXTENSIONS, is_video

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
VIDEO_SUFFIXES = set(VIDEO_EXTENSIONS)  # captioned as videos (`mmpipe.captioning.is_video`)
DIR_PROMPT_FILE = "prompt.txt"


@dataclass(frozen=True)
class ImageItem:
    path: str  # absolute, as found (a symlink stays a symlink: its sidecar goes beside it)
    key: str  # canonical: symlinks resolved; identifies the image in every output
    root: str  # the dataset root it was found under (an input directory, or a file's folder)
    rel: str  # path relative to root, '/'-separated

    @property
    def is_video(self) -> bool:
        return is_video(self.path)

    @classmethod
    def make(cls, path: str, root: str) -> "ImageItem":
        path, root = os.path.abspath(path), os.path.abspath(root)
        return cls(path, os.path.realpath(path), root, os.path.relpath(path, root).replace(os.sep, "/"))


# ---------------------------------------------------------------------- inputs


def collect_images(inputs: Iterable[str]) -> tuple[list[ImageItem], list[str]]:
    """Expand files, directories (recursively; hidden entries skipped) and globs into image and
    video files, each once (first input wins). Returns the images and one message per input that yields
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
        return found, None if found else (f"directory has no images or videos ({', '.join(sorted(IMAGE_SUFFIXES))}; "
                                          f"{', '.join(VIDEO_EXTENSIONS)})")
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
        return [], "matches nothing" if not matches else f"matches {len(matches)} path(s) but no image or video"
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
    return os.path.splitext(path)[1].lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES


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
    """Rank r's deterministic share of the files: every world-th of them sorted by key."""
    return sorted(items, key=lambda i: i.key)[rank::world]


# ---------------------------------------------------------------------- prompts


class PromptResolver:
    """The prompt of each file: the nearest `prompt.txt` in its folder or an ancestor up to its
    dataset root when `per_directory` (for images and videos alike), else the global one of its
    kind (`video_default` for videos; None: `default`)."""

    def __init__(self, default: str, per_directory: bool, video_default: str | None = None) -> None:
        self.default = default
        self.video_default = video_default or default
        self.per_directory = per_directory
        self._cache: dict[str, str | None] = {}

    def __call__(self, item: ImageItem) -> str:
        default = self.video_default if item.is_video else self.default
        if not self.per_directory:
            return default
        folder = os.path.dirname(item.path)
        while True:
            found = self._read(folder)
            if found is not None:
                return found
            if folder == item.root or os.path.dirname(folder) == folder:
                return default
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
