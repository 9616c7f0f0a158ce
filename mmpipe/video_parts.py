"""Video parts of a chat message, as Qwen's `qwen_vl_utils` writes them.

`{"type": "video", "video": SOURCE, KEYS...}` where SOURCE is a path, a `file://` URI, a data URI,
raw bytes, or a list of frames (each anything an image may be: a path, a PIL image, an array...),
and KEYS are the sampling and sizing keys of `mmpipe.vision.video_sampling.VideoOptions`: `fps` or
`nframes`, `min_frames`, `max_frames`, `min_pixels`, `max_pixels`, `total_pixels`,
`resized_height` with `resized_width`, `video_start`, `video_end` (a file), `sample_fps` (a list
of frames). `{"type": "video_url", "video_url": {"url": ...}}` takes a local path, a file:// URI or
a data URI. Network URLs are refused when the video is read, as for images.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from PIL import Image

from mmpipe.errors import InputError
from mmpipe.vision.video_sampling import VideoOptions

VIDEO_KEYS = tuple(f.name for f in fields(VideoOptions))
_ACCEPTED = "'type', 'video', " + ", ".join(repr(key) for key in VIDEO_KEYS)
_FILE_ONLY = ("video_start", "video_end", "fps", "nframes", "min_frames", "max_frames")


@dataclass(frozen=True)
class ChatVideo:
    """A video pulled out of a conversation: a file-like source (path, URI, bytes) or a list of
    frames, and its own sampling and sizing keys."""

    source: Any
    options: VideoOptions = field(default_factory=VideoOptions)

    @property
    def is_frames(self) -> bool:
        return isinstance(self.source, (list, tuple))


def video_of_part(part: dict[str, Any], where: str) -> ChatVideo | None:
    """The video of a `video` or `video_url` part; None for any other part type."""
    kind = part.get("type")
    if kind == "video_url":
        url = part.get("video_url")
        url = url.get("url") if isinstance(url, dict) else url
        extra = [key for key, value in part.items() if key not in ("type", "video_url") and value is not None]
        if not isinstance(url, str) or extra:
            raise InputError(f"{where}: a video_url part is {{'type': 'video_url', 'video_url': {{'url': ...}}}}")
        return ChatVideo(url)
    if kind != "video":
        return None
    unknown = [key for key, value in part.items() if key not in ("type", "video", *VIDEO_KEYS) and value is not None]
    if unknown:
        raise InputError(f"{where}: unknown key {', '.join(repr(k) for k in unknown)} in a video part; "
                         f"accepted: {_ACCEPTED}")
    source = part.get("video")
    if source is None:
        raise InputError(f"{where}: a video part needs 'video': a path, a file:// or data URI, bytes, or a "
                         "list of frames")
    frames = isinstance(source, (list, tuple))
    if frames:
        if not source:
            raise InputError(f"{where}: the video's list of frames is empty")
        for k, frame in enumerate(source):
            if not isinstance(frame, (str, os.PathLike, bytes, bytearray, Image.Image, np.ndarray)):
                raise InputError(f"{where}: frame {k} is a {type(frame).__name__}; frames are paths, bytes, PIL "
                                 "images or arrays")
    elif not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        raise InputError(f"{where}: 'video' must be a path, a file:// or data URI, bytes, or a list of frames; "
                         f"got {type(source).__name__}")
    try:
        options = VideoOptions(**{key: part[key] for key in VIDEO_KEYS if part.get(key) is not None})
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    given = options.given()
    if frames and any(key in given for key in _FILE_ONLY):
        named = ", ".join(key for key in _FILE_ONLY if key in given)
        raise InputError(f"{where}: {named} sample a video file; a list of frames is taken whole")
    if not frames and "sample_fps" in given:
        raise InputError(f"{where}: sample_fps describes a list of frames; a video file has its own frame rate")
    return ChatVideo(list(source) if frames else source, options)
