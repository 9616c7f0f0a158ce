"""What captioning adds to a chat request: the one-file conversation (an image part, or a video
part for a video file), its prompt, the video sampling options of a captioning run, and the caption
or the reason there is none (shared by `Pipeline.caption`, `mmpipe caption` and the Ray Data stage)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from mmpipe.errors import InputError
from mmpipe.outputs import RequestOutput
from mmpipe.video_parts import VIDEO_KEYS
from mmpipe.vision.video_sampling import FRAME_FACTOR, FRAME_MIN_TOKENS, VideoOptions

DEFAULT_CAPTION_PROMPT = "Describe this image."
DEFAULT_VIDEO_PROMPT = "Describe this video."
EMPTY_CAPTION = "the model returned an empty caption"
# Files captioned as videos, known by their extension (any case): the common containers.
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".m2ts", ".flv",
                    ".wmv", ".3gp", ".ogv")
# What a captioning run may set for its videos: a video file's keys (sample_fps describes a list
# of frames, which captioning does not take).
CAPTION_VIDEO_KEYS = tuple(key for key in VIDEO_KEYS if key != "sample_fps")


def caption_result(output: RequestOutput) -> tuple[str | None, str | None]:
    """(caption, error) of a captioning request: the answer stripped, or why there is none (an
    empty answer is an error: a caption file must never be silently empty)."""
    if not output.ok:
        return None, output.error
    text = output.text.strip()
    return (text, None) if text else (None, EMPTY_CAPTION)


_PER_FILE_PREFIX = re.compile(r"^conversation \d+(?:, (image|video) \d+)?: (?:\1 (?:'.*?'|bytes \(\d+ bytes\)): )?")


def per_file_error(reason: str) -> str:
    """A captioning error without the request, image or video it came from, nor the source's own
    name (a path, or "bytes (N bytes)"): for a row or line that names the file itself."""
    return _PER_FILE_PREFIX.sub("", reason)


def is_video(source: Any) -> bool:
    """Whether a captioning source is a video: a path or file:// URI with a video extension
    (`VIDEO_EXTENSIONS`, any case), or a `data:video/...` URI. Anything else is an image."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        return False
    if source[:5].lower() == "data:":
        return source[5:11].lower() == "video/"
    return os.path.splitext(source)[1].lower() in VIDEO_EXTENSIONS


def caption_prompt(source: Any, prompt: str | None = None, video_prompt: str | None = None) -> str:
    """The question asked of one file: for a video `video_prompt`, else `prompt`, else
    "Describe this video."; for an image `prompt`, else "Describe this image."."""
    if is_video(source):
        return video_prompt or prompt or DEFAULT_VIDEO_PROMPT
    return prompt or DEFAULT_CAPTION_PROMPT


def caption_video_options(video: VideoOptions | Mapping[str, Any] | None, factor: int | None = None,
                          where: str = "video") -> VideoOptions:
    """A captioning run's video options, checked before any request: None (Qwen's defaults: 2
    frames a second, 4 to 768 frames, each frame's and the total pixel budget), a
    `VideoOptions`, or a dict of its keys (`CAPTION_VIDEO_KEYS`). With the checkpoint's `factor`
    (patch size x merge size), a `max_pixels` below a frame's smallest area is refused too."""
    if video is None:
        return VideoOptions()
    if isinstance(video, VideoOptions):
        options = video
    elif isinstance(video, Mapping):
        unknown = [key for key in video if key not in CAPTION_VIDEO_KEYS]
        if unknown:
            raise InputError(f"{where}: unknown option {', '.join(repr(k) for k in unknown)}; accepted: "
                             f"{', '.join(CAPTION_VIDEO_KEYS)}")
        try:
            options = VideoOptions(**{key: value for key, value in video.items() if value is not None})
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None
    else:
        raise InputError(f"{where}: give a dict of video options (e.g. dict(fps=2, max_frames=64)) or a "
                         f"VideoOptions, not a {type(video).__name__}")
    if options.sample_fps is not None:
        raise InputError(f"{where}: sample_fps describes a list of frames; captioned videos are files")
    for key in ("nframes", "max_frames"):
        value = getattr(options, key)
        if value is not None and value < FRAME_FACTOR:
            raise InputError(f"{where}: {key}={value}: a video is sampled in pairs of frames; give at least "
                             f"{FRAME_FACTOR}")
    if factor is not None and options.max_pixels is not None:
        smallest = frame_min_pixels(factor) if options.min_pixels is None else options.min_pixels
        if options.max_pixels < smallest:
            raise InputError(f"{where}: max_pixels={options.max_pixels} is below a video frame's smallest area, "
                             f"min_pixels={smallest}" + ("" if options.min_pixels is not None else
                                                         f" ({FRAME_MIN_TOKENS} tokens of {factor}x{factor} pixels)"))
    return options


def frame_min_pixels(factor: int) -> int:
    """A video frame's smallest area by default (Qwen's: 128 merged tokens of factor x factor)."""
    return FRAME_MIN_TOKENS * factor * factor


def caption_conversation(source: Any, prompt: str | None = None, video: VideoOptions | None = None,
                         name: str | None = None) -> list[dict[str, Any]]:
    """The one-turn conversation that captions `source`: a video part with `video`'s keys when it
    is a video (`is_video` of `name`, the file's name, when given: a path column beside a bytes
    column), else an image part; `prompt` None asks the kind's default question."""
    if is_video(source if name is None else name):
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        part = {"type": "video", "video": source, **(video.given() if video is not None else {})}
        text = prompt or DEFAULT_VIDEO_PROMPT
    else:
        part = {"type": "image", "image": source}
        text = prompt or DEFAULT_CAPTION_PROMPT
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]
