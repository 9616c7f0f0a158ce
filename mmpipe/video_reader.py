"""Reading video files with PyAV: exact frame counts, and decoding only the frames asked for.

A `VideoFile` opens a path, a `file://` URI, raw bytes or a `data:` URI (network URLs are
refused, never fetched). Frame i is the stream's i-th frame in presentation order: the i-th
smallest presentation timestamp among the stream's packets, found by demuxing without decoding.
`read` decodes just the wanted frames, seeking to the keyframe before a wanted frame when that
skips decoding, and hands each RGB frame to a callback as soon as it is decoded, so host memory
holds a few frames whatever the video's length. Every failure is a `VideoLoadError` that names
the source and the problem.

The display matrix's rotation (phones' portrait videos) is applied: `VideoInfo` gives the size as
displayed and `read` returns upright frames. A mirroring display matrix is not applied.

`device="gpu"` decodes with NVDEC through FFmpeg's CUDA hwaccel (frames still come back to host
memory); where no CUDA device or driver is found it says so in the log and decodes on the CPU.
A codec NVDEC lacks is decoded on the CPU too.
"""

from __future__ import annotations

import bisect
import io
import itertools
import logging
import operator
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, Union

import av
import numpy as np
from av.codec.hwaccel import HWAccel

from mmpipe.errors import ImageLoadError, VideoLoadError
from mmpipe.inputs import _DATA_URI, _URL, _decode_base64, _file_uri_path, describe_source

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("mmpipe")

VideoSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]
T = TypeVar("T")

# Containers whose header holds an exact frame count (the sample table of mp4/mov). Elsewhere
# (mkv/webm, avi, ts, ...) the header's count is absent or unreliable, so packets are counted.
_HEADER_COUNT_FORMATS = ("mov", "mp4")
# Containers whose header stores each stream's duration; elsewhere FFmpeg's figure may be a guess.
_STATED_DURATION_FORMATS = ("mov", "matroska", "avi")
_NOT_DECODABLE = "(the file ends early or is corrupt)"


@dataclass(frozen=True)
class VideoInfo:
    """What a video holds: its exact frame count, frame rate, size as displayed, codec and length
    in seconds."""

    total_frames: int
    fps: float
    height: int
    width: int
    codec: str
    duration: float


@dataclass(frozen=True)
class _Timeline:
    """The stream's frames in presentation order, from one demux pass (no decoding)."""

    count: int  # frames present in the file
    pts: list[int]  # presentation timestamp of each frame, ascending; empty when not `timed`
    by_pts: dict[int, int]  # presentation timestamp -> frame index
    keyframes: list[int]  # frame indices of keyframes, ascending
    timed: bool  # every packet has its own timestamp: frames are known by it and seeking works
    claimed: int  # frames the file says it holds: more than `count` when it ends early


class VideoFile:
    """One open video. Not for use by several threads at once: each worker opens its own.

    `threads`: codec threads for decoding (1: each pipeline worker decodes its own video, and
    more codec threads would oversubscribe the cores; 0: FFmpeg's choice). `device`: "cpu", or
    "gpu" for NVDEC where there is one."""

    def __init__(self, source: VideoSource, *, threads: int = 1, device: str = "cpu") -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
        self._gpu = device == "gpu"
        self.name = describe_source(source)
        self.frames_decoded = 0  # frames the decoder produced, for checking how little was decoded
        self.seeks = 0
        self._threads = threads
        self._target = self._resolve(source)
        self._container: Any = None
        self._timeline_cache: _Timeline | None = None
        self._frames: Iterator[Any] | None = None  # decoded frames from the current position on
        self._position = -1  # index of the last frame the decoder gave
        self._open()
        try:
            first = next(self._frames_from_here(), None)  # can this stream be decoded? its rotation?
            if first is None:
                raise VideoLoadError(f"video {self.name}: no frame could be decoded {_NOT_DECODABLE}")
            self._rotation = round((first.rotation or 0) / 90.0) % 4  # quarter turns, counter-clockwise
            self._header_count = self._count_in_header()
            self._info = self._read_info()
        except BaseException:
            self.close()
            raise

    def _resolve(self, source: Any) -> str | bytes:
        """What `av.open` reads, checked: a local file's URL (FFmpeg reads it in pieces, never
        whole) or the bytes."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        elif not isinstance(source, (str, os.PathLike)) or not isinstance(os.fspath(source), str):
            raise VideoLoadError(f"video {self.name}: unsupported input; pass a path, a file:// URI, bytes or "
                                 "a data: URI")
        elif (text := os.fspath(source)).startswith("data:"):
            data = self._data_uri_bytes(text)
        elif text[:6].lower() == "file:/":
            try:
                local = _file_uri_path(text, self.name)
            except ImageLoadError as exc:
                raise _video_error(exc) from None
            return self._checked_path(local, f" ({local})")
        elif _URL.match(text):
            raise VideoLoadError(f"video {self.name}: URLs are not fetched; download the file and pass its path")
        else:
            return self._checked_path(text, "")
        if not data:
            raise VideoLoadError(f"video {self.name}: is empty (0 bytes)")
        return data

    def _checked_path(self, path: str, shown: str) -> str:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise VideoLoadError(f"video {self.name}: no such file{shown}") from None
        except OSError as exc:
            raise VideoLoadError(f"video {self.name}: cannot read ({_reason(exc)})") from exc
        if stat.S_ISDIR(info.st_mode):
            raise VideoLoadError(f"video {self.name}: is a directory, not a video file{shown}")
        if info.st_size == 0 and stat.S_ISREG(info.st_mode):
            raise VideoLoadError(f"video {self.name}: is empty (0 bytes){shown}")
        return "file:" + os.path.abspath(path)  # "file:": a path with a colon is not another protocol

    def _data_uri_bytes(self, uri: str) -> bytes:
        match = _DATA_URI.match(uri)
        if match is None:
            raise VideoLoadError(f"video {self.name}: malformed data URI (expected 'data:[<type>][;base64],<data>')")
        mime = (match.group("mime") or "").lower()
        if mime and not mime.startswith("video/") and mime != "application/octet-stream":
            raise VideoLoadError(f"video {self.name}: data URI has media type {mime!r}, not a video")
        if not match.group("b64"):
            raise VideoLoadError(f"video {self.name}: data URI is not base64-encoded")
        try:
            return _decode_base64(uri[match.end():], self.name, "data URI payload")
        except ImageLoadError as exc:
            raise _video_error(exc) from None

    def _open_container(self, decoding: bool = False) -> Any:
        """A new opening of the file; `decoding`: with NVDEC when asked for and there is one."""
        def target() -> Any:
            return io.BytesIO(self._target) if isinstance(self._target, bytes) else self._target

        if decoding and self._gpu:
            try:
                return av.open(target(), metadata_errors="ignore", hwaccel=HWAccel("cuda", allow_software_fallback=True))
            except (av.FFmpegError, OSError) as exc:
                log.info("video %s: NVDEC decoding unavailable (%s); decoding on the CPU", self.name, _reason(exc))
                self._gpu = False
        try:
            return av.open(target(), metadata_errors="ignore")
        except av.error.InvalidDataError:
            raise VideoLoadError(f"video {self.name}: not a recognised video container (corrupt or not a "
                                 "video file)") from None
        except (av.FFmpegError, OSError) as exc:
            raise VideoLoadError(f"video {self.name}: cannot open ({_reason(exc)})") from exc

    def _open(self) -> None:
        """(Re)open the container at its start and pick its video stream."""
        self.close()
        container = self._open_container(decoding=True)
        streams = [s for s in container.streams.video
                   if not s.disposition & av.stream.Disposition.attached_pic]  # not cover art
        if not streams:
            kinds = sorted({"cover art" if s.type == "video" else s.type for s in container.streams}) or ["nothing"]
            container.close()
            raise VideoLoadError(f"video {self.name}: has no video stream (it holds {', '.join(kinds)})")
        stream = streams[0]
        if stream.codec_context is None:
            container.close()
            raise VideoLoadError(f"video {self.name}: its video codec cannot be decoded by the FFmpeg that "
                                 f"PyAV {av.__version__} bundles")
        stream.codec_context.thread_count = self._threads
        if self._threads != 1:
            stream.codec_context.thread_type = "AUTO"
        self._container, self._stream = container, stream
        self._frames, self._position = None, -1

    def close(self) -> None:
        """Release the file and the decoder."""
        self._frames = None
        if self._container is not None:
            self._container.close()
            self._container = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def info(self) -> VideoInfo:
        """Frame count, rate, displayed size, codec and duration."""
        return self._info

    def _count_in_header(self) -> int | None:
        """The exact frame count of an mp4/mov header: its sample table less the samples its edit
        list drops (`stream.frames` counts those too). None for other containers."""
        stream = self._stream
        if self._container.format.name.split(",")[0] not in _HEADER_COUNT_FORMATS or not stream.frames:
            return None
        return sum(1 for entry in stream.index_entries if not entry.is_discard)

    def _read_info(self) -> VideoInfo:
        stream, context = self._stream, self._stream.codec_context
        seconds = _stated_seconds(self._container, stream)  # the container's may be the audio's
        rate = stream.average_rate or stream.guessed_rate
        total = self._header_count if self._header_count is not None else self._timeline(float(rate or 0)).claimed
        span = seconds or (self._container.duration or 0) / av.time_base
        fps = float(rate) if rate else (total / span if span else 0.0)
        height, width = (context.width, context.height) if self._rotation % 2 else (context.height, context.width)
        return VideoInfo(total_frames=total, fps=fps, height=height, width=width, codec=context.name,
                         duration=seconds if seconds else (total / fps if fps else 0.0))

    def _timeline(self, fps: float | None = None) -> _Timeline:
        """The stream's frames in presentation order, from demuxing it once (a separate opening,
        no decoding); cached."""
        if self._timeline_cache is None:
            container = self._open_container()
            try:
                fps = self._info.fps if fps is None else fps
                self._timeline_cache = _scan(container, self._stream.index, self._header_count, fps)
            finally:
                container.close()
        return self._timeline_cache

    def read(self, indices: Sequence[int], each: Callable[[np.ndarray], T]) -> list[T]:
        """Decode the frames at `indices` (0-based, presentation order, in increasing order), handing
        each as an RGB uint8 HxWx3 array to `each` as soon as it is decoded; the results of `each`,
        in index order. Only `each`'s result is kept of a frame."""
        if self._container is None:
            raise ValueError(f"video {self.name}: is closed")
        wanted = [operator.index(i) for i in indices]
        if any(b < a for a, b in itertools.pairwise(wanted)):
            raise ValueError(f"video {self.name}: frame indices must be in increasing order, got {wanted}")
        total = self.info.total_frames
        for index in wanted:
            if not 0 <= index < total:
                raise VideoLoadError(f"video {self.name}: frame index {index} is out of range (the video has "
                                     f"{total} frames, 0 to {total - 1})")
        results: list[T] = []
        frame, at = None, -1
        for index in wanted:
            if index != at:  # a repeated index is the same frame again
                frame, at = self._decode_to(index), index
            results.append(each(self._to_rgb(frame)))
        return results

    def _decode_to(self, target: int) -> Any:
        """The decoded frame at `target`: decode forward from where the decoder is, or first seek to
        the keyframe before `target` when that skips frames or `target` is behind."""
        timeline = self._timeline()
        frame = None
        if target < timeline.count:
            start = self._keyframe_before(target)
            if self._frames is None or target <= self._position or (start is not None and start > self._position + 1):
                self._start_at(start)
            frame = self._forward_to(target)
            if frame is None and start is not None:  # the seek landed past it: decode from the start
                self._start_at(None)
                frame = self._forward_to(target)
        if frame is None:
            raise VideoLoadError(f"video {self.name}: frame {target} of {self.info.total_frames} could not be "
                                 f"decoded {_NOT_DECODABLE}")
        return frame

    def _keyframe_before(self, target: int) -> int | None:
        """The frame index of the last keyframe at or before `target`; None when frames are not
        timed (decode from the start) or no keyframe precedes it."""
        timeline = self._timeline()
        if not timeline.timed:
            return None
        at = bisect.bisect_right(timeline.keyframes, target) - 1
        return timeline.keyframes[at] if at >= 0 else None

    def _start_at(self, keyframe: int | None) -> None:
        """Point the decoder at a keyframe (a frame index), or at the file's start (None)."""
        timeline = self._timeline()
        self._frames, self._position = None, -1
        if keyframe is not None:
            try:  # lands on the last keyframe at or before that presentation time
                self._container.seek(timeline.pts[keyframe], stream=self._stream, backward=True)
                self.seeks += 1
                self._frames, self._position = self._frames_from_here(), keyframe - 1
                return
            except (av.FFmpegError, OSError):
                pass  # not seekable here: read from the start instead
        self._open()
        self._frames = self._frames_from_here()

    def _forward_to(self, target: int) -> Any:
        """Decode forward until the frame at `target`; None if the stream ends or skips past it."""
        assert self._frames is not None
        timeline = self._timeline()
        for frame in self._frames:
            index = timeline.by_pts.get(frame.pts) if timeline.timed else self._position + 1
            if index is None:
                continue  # a frame without a timestamp of the stream's packets
            self._position = index
            if index == target:
                return frame
            if index > target:
                return None
        self._frames = None
        return None

    def _frames_from_here(self) -> Iterator[Any]:
        """Decoded frames from the demuxer's position on. A packet the decoder refuses is skipped;
        a demuxing error ends the stream (the decoder's delayed frames still come out)."""
        container, stream = self._container, self._stream
        try:
            for packet in container.demux(stream):
                try:
                    frames = packet.decode()
                except av.FFmpegError:
                    continue
                for frame in frames:
                    self.frames_decoded += 1
                    yield frame
        except (av.FFmpegError, OSError):
            try:
                frames = stream.codec_context.decode(None)
            except av.FFmpegError:
                return
            for frame in frames:
                self.frames_decoded += 1
                yield frame

    def _to_rgb(self, frame: Any) -> np.ndarray:
        rgb = frame.to_ndarray(format="rgb24")
        return np.ascontiguousarray(np.rot90(rgb, self._rotation)) if self._rotation else rgb


def _scan(container: Any, index: int, header_count: int | None, fps: float) -> _Timeline:
    """Each packet's timestamps and keyframe flag, sorted into presentation order. A file that
    ends early (a demuxing error, a corrupt last packet, fewer packets than its header or its
    stated duration says) loses its last packet, which is likely cut, and the frames that may
    have been cut from between the others: those presented after the last packet's decoding time
    (a missing packet's presentation time is at least its decoding time, which is later)."""
    stream = container.streams[index]
    packets: list[tuple[int | None, int | None, bool]] = []
    broken = False
    try:
        for packet in container.demux(stream):
            if packet.size and not packet.is_discard:
                packets.append((packet.pts, packet.dts, packet.is_keyframe))
                broken = packet.is_corrupt
    except (av.FFmpegError, OSError):
        broken = True
    stamps = [pts for pts, _, _ in packets]
    timed = None not in stamps and len(set(stamps)) == len(stamps)
    seconds = _stated_seconds(container, stream)
    claimed = header_count if header_count is not None else len(packets)
    if seconds is not None and header_count is None and fps > 0:
        span = ((max(stamps) - min(stamps)) * stream.time_base if timed and stamps else len(packets) / fps)
        if seconds - float(span) > 2.5 / fps:
            claimed = max(claimed, round(seconds * fps))
    if (broken or claimed > len(packets)) and packets:
        packets.pop()
        cutoff = next((dts for _, dts, _ in reversed(packets) if dts is not None), None)
        if timed and cutoff is not None:
            packets = [p for p in packets if p[0] <= cutoff]
        claimed = max(claimed, len(packets) + 1)
    ordered = sorted(packets, key=lambda p: p[0]) if timed else []
    pts = [p[0] for p in ordered]
    return _Timeline(count=len(packets), pts=pts, by_pts={p: i for i, p in enumerate(pts)},
                     keyframes=[i for i, p in enumerate(ordered) if p[2]], timed=timed, claimed=claimed)


def _stated_seconds(container: Any, stream: Any) -> float | None:
    """The stream's own duration as the header states it (mkv/webm: its DURATION tag), if it does."""
    if container.format.name.split(",")[0] not in _STATED_DURATION_FORMATS:
        return None
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    hours, _, rest = str(stream.metadata.get("DURATION", "")).partition(":")
    minutes, _, secs = rest.partition(":")
    try:
        return int(hours) * 3600 + int(minutes) * 60 + float(secs)
    except ValueError:
        return None


def _video_error(exc: ImageLoadError) -> VideoLoadError:
    """The same message about a video: the shared source helpers of `mmpipe.inputs` word their
    errors as "image <name>: ..."."""
    text = str(exc)
    return VideoLoadError("video" + text[len("image"):] if text.startswith("image ") else text)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text or type(exc).__name__
