"""Which frames of a video the model sees, and at what size: Qwen's `qwen_vl_utils` rules.

A video is sampled at `fps` frames a second (default 2) between 4 and 768 frames, or at exactly
`nframes`, always an even count (the towers take frames in pairs), picked evenly over
[video_start, video_end]. Each frame is then sized like an image, with a video's own limits: at
least 128 and at most 768 merged tokens a frame, and a total pixel budget shared by all frames
(`total_pixels`, default 90% of a 128000-token context), all in units of (patch x merge)^2 for the
checkpoint's patch size (14 or 16). A list of frames (already sampled, at `sample_fps`) has each
frame sized as an image first, padded to an even count with its last frame.

The numbers here equal `qwen_vl_utils.vision_process` (0.0.14): `frame_range` is its
`calculate_video_frame_range`, `frame_count` its `smart_nframes`, `frame_size` the sizing of its
`fetch_video`. Resizing itself is `mmpipe.vision.video_frames`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import numpy as np
from mmpipe.vision.preprocess import fetch_size

from mmpipe.errors import InputError

FPS = 2.0
FRAME_FACTOR = 2
MIN_FRAMES = 4
MAX_FRAMES = 768
FRAME_MIN_TOKENS = 128
FRAME_MAX_TOKENS = 768
CONTEXT_TOKENS = 128000  # qwen_vl_utils' MODEL_SEQ_LEN: the default total budget is 90% of it

_INTEGER_KEYS = ("nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels",
                 "resized_height", "resized_width")
_SECONDS_KEYS = ("fps", "sample_fps", "video_start", "video_end")


@dataclass(frozen=True)
class VideoOptions:
    """One video's sampling and sizing keys, as a `{"type": "video", ...}` part writes them (None:
    the default). `fps` and `nframes` exclude each other; `resized_height` and `resized_width` go
    together; `sample_fps` only describes a list of frames; `video_start`/`video_end` only cut
    a file."""

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    resized_height: int | None = None
    resized_width: int | None = None
    video_start: float | None = None
    video_end: float | None = None
    sample_fps: float | None = None

    def __post_init__(self) -> None:
        for name in _INTEGER_KEYS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InputError(f"{name} must be a positive whole number, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in _SECONDS_KEYS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise InputError(f"{name} must be a number, got {value!r}")
            low_ok = value >= 0 if name.startswith("video_") else value > 0
            if not low_ok:
                raise InputError(f"{name} must be {'0 or more' if name.startswith('video_') else 'positive'}, "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.fps is not None and self.nframes is not None:
            raise InputError("give fps or nframes, not both")
        if (self.resized_height is None) != (self.resized_width is None):
            raise InputError("resized_height and resized_width go together")
        if self.min_frames is not None and self.max_frames is not None and self.min_frames > self.max_frames:
            raise InputError(f"min_frames={self.min_frames} is above max_frames={self.max_frames}")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise InputError(f"min_pixels={self.min_pixels} is above max_pixels={self.max_pixels}")
        if (self.video_start is not None and self.video_end is not None and self.video_start >= self.video_end):
            raise InputError(f"video_start={self.video_start} is not before video_end={self.video_end}")

    def given(self) -> dict[str, float | int]:
        """The keys set, by name (for messages and cache keys)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def frame_range(options: VideoOptions, total_frames: int, video_fps: float) -> tuple[int, int, int]:
    """(first frame, last frame, frames between them) of [video_start, video_end] in a file of
    `total_frames` at `video_fps`; both ends clamped to the file."""
    if video_fps <= 0:
        raise InputError(f"the video's frame rate ({video_fps}) is not positive")
    if total_frames <= 0:
        raise InputError("the video has no frames")
    if options.video_start is None and options.video_end is None:
        return 0, total_frames - 1, total_frames
    duration = total_frames / video_fps
    start = 0.0 if options.video_start is None else max(0.0, min(options.video_start, duration))
    end = duration if options.video_end is None else max(0.0, min(options.video_end, duration))
    first = math.ceil(start * video_fps)
    last = total_frames - 1 if options.video_end is None else min(math.floor(end * video_fps), total_frames - 1)
    if first >= last:
        raise InputError(f"video_start={options.video_start} and video_end={options.video_end} leave no frames "
                         f"(first frame {first}, last {last}) of a {duration:.2f} s video ({total_frames} frames "
                         f"at {video_fps:g} fps)")
    return first, last, last - first + 1


def frame_count(options: VideoOptions, total_frames: int, video_fps: float) -> int:
    """How many frames to sample from `total_frames` at `video_fps` (an even number)."""
    if options.nframes is not None:
        count = round_by_factor(options.nframes, FRAME_FACTOR)
    else:
        fps = FPS if options.fps is None else options.fps
        min_frames = ceil_by_factor(MIN_FRAMES if options.min_frames is None else options.min_frames, FRAME_FACTOR)
        max_frames = floor_by_factor(min(MAX_FRAMES, total_frames) if options.max_frames is None
                                     else options.max_frames, FRAME_FACTOR)
        count = total_frames / video_fps * fps
        count = floor_by_factor(min(max(count, min_frames), max_frames, total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= count <= total_frames:
        asked = (f"nframes={options.nframes}" if options.nframes is not None
                 else f"min_frames={options.min_frames or MIN_FRAMES}, max_frames={options.max_frames}")
        raise InputError(f"the video (or its [video_start, video_end] cut) has {total_frames} frames; {asked} asks "
                         f"for {count}, which must be between {FRAME_FACTOR} and {total_frames}")
    return count


@dataclass(frozen=True)
class FrameSample:
    """The frames to decode from a file and the rate they stand for."""

    indices: list[int]  # 0-based, increasing
    video_fps: float  # the file's frame rate (Qwen3-VL's timestamps)
    sample_fps: float  # frames kept per second of video (Qwen2.5-VL's temporal positions)


def sample_frames(options: VideoOptions, total_frames: int, video_fps: float) -> FrameSample:
    """The frames picked evenly over the cut, as `torch.linspace(first, last, n).round()` picks
    them (numpy's linspace and round-half-to-even give the same integers)."""
    if options.sample_fps is not None:
        raise InputError("sample_fps describes a list of frames; a video file has its own frame rate")
    first, last, in_range = frame_range(options, total_frames, video_fps)
    count = frame_count(options, in_range, video_fps)
    indices = _linspace_round(first, last, count)
    return FrameSample(indices, float(video_fps), count / max(in_range, 1e-6) * video_fps)


def _linspace_round(first: int, last: int, count: int) -> list[int]:
    """torch.linspace(first, last, count) in float32, rounded half to even."""
    import torch

    return torch.linspace(first, last, count).round().long().tolist()


def frame_size(height: int, width: int, frames: int, options: VideoOptions, factor: int) -> tuple[int, int]:
    """The (height, width) every frame of a `frames`-frame video is resized to."""
    if options.resized_height is not None and options.resized_width is not None:
        return fetch_size(options.resized_height, options.resized_width, factor)
    min_pixels = FRAME_MIN_TOKENS * factor * factor if options.min_pixels is None else options.min_pixels
    total = CONTEXT_TOKENS * factor * factor * 0.9 if options.total_pixels is None else options.total_pixels
    max_pixels = max(min(FRAME_MAX_TOKENS * factor * factor, total / frames * FRAME_FACTOR), int(min_pixels * 1.05))
    if options.max_pixels is not None:
        max_pixels = min(options.max_pixels, max_pixels)
    if min_pixels > max_pixels:
        raise InputError(f"min_pixels={min_pixels} is above the frame budget of {max_pixels:g} pixels "
                         f"(max_pixels, or total_pixels over {frames} frames)")
    return fetch_size(height, width, factor, min_pixels, max_pixels)


def list_frame_count(given: int) -> int:
    """A list of frames is padded with its last frame to an even count."""
    if given < 1:
        raise InputError("a video given as a list of frames needs at least one frame")
    return ceil_by_factor(given, FRAME_FACTOR)


def group_timestamps(indices: list[int], video_fps: float, temporal: int = FRAME_FACTOR) -> list[float]:
    """Seconds at the middle of each frame group (transformers' Qwen3-VL `_calculate_timestamps`:
    the mean of the group's first and last frame times, the index list padded with its last)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    seconds = [i / video_fps for i in padded]
    return [(seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal)]


def seconds_per_group(sample_fps: float, temporal: int = FRAME_FACTOR) -> float:
    """Qwen2.5-VL's `second_per_grid_t`: how much time one frame group spans, as float32 (the
    processor hands it to the model as a float32 tensor)."""
    return float(np.float32(temporal / sample_fps))
