"""The video files `mmpipe bench video` reads: H.264 mp4 files written with PyAV's libx264, each
frame drawn straight into the encoder's YUV 4:2:0 planes (no colour conversion, so writing is
quick), named by their spec so a second run reuses them.

Each file has content of its own (a seed): a canvas of coarse random blocks with a gradient and
fine texture, panned a little from frame to frame, and a strip of blocks along the top that
spells the frame's index in binary. No two frames of a file, and no frames of two files, are the
same, so the encoder cache never finds a frame group it has seen.

A long file is encoded in segments of whole keyframe intervals on a process pool, one encoder
each, and the segments' packets are joined into one file (without B-frames, so presentation and
decoding order agree and timestamps only shift). The clips keep the preset's B-frames.

This module imports no torch: pool workers start quickly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from fractions import Fraction
from multiprocessing import get_context
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # PyAV is imported where clips are drawn and written: other benches run without it
    import av

MARGIN = 64  # pixels the canvas extends past the frame: the pan's range
KEYINT = 250  # libx264's default keyframe interval, written out so segments can start on one
INDEX_BITS = 20  # the top strip spells frame indices below 2**20


@dataclass(frozen=True)
class ClipSpec:
    """What every file of a set shares."""

    seconds: float
    fps: float
    width: int
    height: int
    preset: str = "veryfast"
    bframes: bool = True  # libx264's B-frames as its preset sets them; False: none (files to join)

    def __post_init__(self) -> None:
        if self.width % 2 or self.height % 2 or self.width < 16 or self.height < 16:
            raise ValueError(f"frame size {self.width}x{self.height}: both sides must be even and at least 16 "
                             "(H.264 in 4:2:0)")
        if self.seconds <= 0 or self.fps <= 0:
            raise ValueError(f"seconds ({self.seconds}) and fps ({self.fps}) must be positive")

    @property
    def frames(self) -> int:
        return max(1, round(self.seconds * self.fps))

    @property
    def rate(self) -> Fraction:
        return Fraction(self.fps).limit_denominator(1001)

    @property
    def name(self) -> str:
        return (f"{self.width}x{self.height}_{self.fps:g}fps_{self.frames}f_{self.preset}"
                + ("" if self.bframes else "_nobframes"))


def parse_size(text: str) -> tuple[int, int]:
    """'640x360' -> (640, 360)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"size {text!r}: write it WIDTHxHEIGHT, e.g. 640x360") from None
    return width, height


class Canvas:
    """One file's drawing: planes a little larger than the frame, cut at a moving offset."""

    def __init__(self, width: int, height: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.width, self.height = width, height
        rows, cols = height + MARGIN, width + MARGIN
        block = max(8, min(width, height) // 12)
        coarse = rng.integers(24, 200, (rows // block + 1, cols // block + 1), dtype=np.uint8)
        luma = np.kron(coarse, np.ones((block, block), np.uint8))[:rows, :cols].astype(np.int16)
        luma += (np.add.outer(np.arange(rows), np.arange(cols)) * 32 // (rows + cols)).astype(np.int16)
        luma += rng.integers(0, 24, (rows, cols), dtype=np.int16)
        self.luma = np.clip(luma, 16, 235).astype(np.uint8)
        half = (rows // 2, cols // 2)
        self.chroma = [np.kron(rng.integers(64, 192, (half[0] // block + 1, half[1] // block + 1), dtype=np.uint8),
                               np.ones((block, block), np.uint8))[:half[0], :half[1]] for _ in range(2)]
        self.bit_width = max(1, width // INDEX_BITS)
        self.strip = min(8, height // 4) & ~1

    def frame(self, index: int) -> av.VideoFrame:
        """Frame `index` as a yuv420p frame (planes written in place)."""
        import av

        swing = index % (2 * MARGIN)
        dx = swing if swing < MARGIN else 2 * MARGIN - swing
        dy = dx // 2
        frame = av.VideoFrame(self.width, self.height, "yuv420p")
        half = (self.width // 2, self.height // 2)
        for plane, source, (x, y), (w, h) in zip(
                frame.planes, [self.luma, *self.chroma], [(dx, dy), (dx // 2, dy // 2), (dx // 2, dy // 2)],
                [(self.width, self.height), half, half]):
            view = np.frombuffer(plane, np.uint8).reshape(h, plane.line_size)
            view[:, :w] = source[y:y + h, x:x + w]
        luma = np.frombuffer(frame.planes[0], np.uint8).reshape(self.height, frame.planes[0].line_size)
        for bit in range(INDEX_BITS):
            luma[:self.strip, bit * self.bit_width:(bit + 1) * self.bit_width] = 235 if index >> bit & 1 else 16
        return frame


def encode(path: str, spec: ClipSpec, seed: int, first: int = 0, count: int | None = None, threads: int = 0) -> str:
    """Write frames [first, first + count) of the file with `seed` to `path` (timestamps from 0),
    through a temporary name, so an interrupted run leaves no file that looks whole. `threads`:
    the encoder's (0: its own choice)."""
    count = spec.frames - first if count is None else count
    canvas = Canvas(spec.width, spec.height, seed)
    import av

    partial = f"{path}.partial.mp4"
    with av.open(partial, mode="w") as container:
        stream = container.add_stream("libx264", rate=spec.rate)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.codec_context.thread_count = threads
        params = f"keyint={KEYINT}:log-level=error" + ("" if spec.bframes else ":bframes=0")
        stream.options = {"preset": spec.preset, "x264-params": params}
        time_base = 1 / spec.rate
        for k in range(count):
            frame = canvas.frame(first + k)
            frame.pts, frame.time_base = k, time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    os.replace(partial, path)
    return path


Job = tuple[str, ClipSpec, int, int, "int | None", int]  # encode's arguments


def _encode_args(args: Job) -> str:
    return encode(*args)


def _run(jobs: list[Job], workers: int) -> None:
    """Encode `jobs`, on a pool of processes when there are several, the cores shared out
    between their encoders."""
    workers = min(workers, len(jobs))
    if workers <= 1:
        for job in jobs:
            _encode_args(job)
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: the bench process holds torch's threads (and later CUDA); a fork would copy them.
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_encode_args, [(*job[:5], threads) for job in jobs]))


def write_clips(folder: str, spec: ClipSpec, seeds: Sequence[int], workers: int = 1) -> list[str]:
    """One file per seed in `folder` (a subfolder named by the spec), reusing those already there."""
    where = os.path.join(folder, spec.name)
    os.makedirs(where, exist_ok=True)
    paths = [os.path.join(where, f"clip-{seed:06d}.mp4") for seed in seeds]
    _run([(path, spec, seed, 0, None, 0) for path, seed in zip(paths, seeds) if not os.path.exists(path)], workers)
    return paths


def write_long(folder: str, spec: ClipSpec, seed: int = 1 << 20, workers: int = 1) -> str:
    """One long file in `folder`, reused if there; segments of whole keyframe intervals are
    encoded in parallel and joined (so it has no B-frames)."""
    spec = replace(spec, bframes=False)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"long_{spec.name}.mp4")
    if os.path.exists(path):
        return path
    total = spec.frames
    per = KEYINT * max(1, math.ceil(total / KEYINT / max(workers, 1)))
    if workers <= 1 or per >= total:
        return encode(path, spec, seed)
    starts = list(range(0, total, per))
    parts = [f"{path}.seg{k:03d}.mp4" for k in range(len(starts))]
    _run([(part, spec, seed, start, min(per, total - start), 0) for part, start in zip(parts, starts)], workers)
    join(parts, path)
    for part in parts:
        os.remove(part)
    return path


def join(parts: Sequence[str], path: str) -> str:
    """Concatenate mp4 files of one encoder setting (no B-frames) into `path` without re-encoding:
    each part's timestamps shifted past the end of the previous ones."""
    import av

    partial = f"{path}.partial.mp4"
    with av.open(partial, mode="w") as out:
        target, offset = None, 0
        for part in parts:
            with av.open(part) as source:
                stream = source.streams.video[0]
                if target is None:
                    target = out.add_stream_from_template(stream)
                end = offset
                for packet in source.demux(stream):
                    if packet.dts is None:  # the demuxer's closing empty packet
                        continue
                    packet.pts += offset
                    packet.dts += offset
                    end = max(end, packet.pts + (packet.duration or 0))
                    packet.stream = target
                    out.mux(packet)
                offset = end
    os.replace(partial, path)
    return path
