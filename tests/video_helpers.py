"""Test helpers for video: small real files written with PyAV's encoders, and the frames a plain
sequential PyAV decode gives (the reference for what frame i is)."""

from __future__ import annotations

import os
from fractions import Fraction
from typing import Any

import av
import numpy as np

# Per codec: the pixel format it takes by default here and options that keep encoding quick and
# quiet. libx264 keeps B-frames (presentation order differs from decoding order).
CODEC_DEFAULTS: dict[str, tuple[str, dict[str, str]]] = {
    "libx264": ("yuv420p", {"preset": "veryfast"}),
    "libx265": ("yuv420p", {"preset": "ultrafast", "x265-params": "log-level=error"}),
    "libvpx-vp9": ("yuv420p", {"deadline": "realtime", "cpu-used": "8"}),
    "mpeg4": ("yuv420p", {}),
    "mjpeg": ("yuvj444p", {}),
}


def frame_pattern(index: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """An RGB uint8 frame that codecs keep recognisable: smooth gradients that move with the frame
    index, and a coarse block pattern that differs from frame to frame."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    phase = index / 17.0 + seed
    red = 128 + 100 * np.sin(2 * np.pi * (x / max(width, 1) + phase))
    green = 128 + 100 * np.cos(2 * np.pi * (y / max(height, 1) - 0.7 * phase))
    rng = np.random.default_rng(seed * 100_003 + index)
    blocks = rng.integers(0, 2, size=(4, 4)) * 180 + 40
    blue = blocks[(y * 4 // height).astype(int), (x * 4 // width).astype(int)]
    return np.clip(np.stack([red, green, blue], axis=-1), 0, 255).astype(np.uint8)


def make_video(path: str | os.PathLike[str], n_frames: int, width: int, height: int,
               fps: Fraction | float = 24, codec: str = "libx264", pix_fmt: str | None = None,
               seed: int = 0, gop: int | None = None, rotation: int = 0, first_pts: int = 0,
               options: dict[str, str] | None = None, container_options: dict[str, str] | None = None) -> str:
    """Write `n_frames` of `frame_pattern` to `path` (container chosen by its extension) and return
    the path. `gop`: a keyframe every `gop` frames exactly (scene-cut keyframes off). `rotation`:
    display-matrix rotation in degrees (counter-clockwise), as phones write it. `first_pts`: the
    first frame's timestamp in frames (below 0: an mp4's edit list drops those frames)."""
    path = os.fspath(path)
    rate = Fraction(fps).limit_denominator(1_000_000) if not isinstance(fps, Fraction) else fps
    default_fmt, default_options = CODEC_DEFAULTS.get(codec, ("yuv420p", {}))
    with av.open(path, mode="w", options=container_options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt or default_fmt
        opts = dict(default_options)
        if gop is not None:
            stream.codec_context.gop_size = gop
            opts["sc_threshold"] = "0"
            if codec == "libx264":
                opts["x264-params"] = f"keyint={gop}:min-keyint={gop}:scenecut=0"
            elif codec == "libx265":
                opts["x265-params"] = f"log-level=error:keyint={gop}:min-keyint={gop}:scenecut=0"
        opts.update(options or {})
        stream.options = opts
        if rotation:
            stream.set_display_rotation(rotation)
        for index in range(n_frames):
            frame = av.VideoFrame.from_ndarray(frame_pattern(index, width, height, seed), format="rgb24")
            frame.pts = first_pts + index
            frame.time_base = 1 / rate
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def make_audio(path: str | os.PathLike[str], seconds: float = 0.5, codec: str = "pcm_s16le",
               rate: int = 8000) -> str:
    """An audio-only file (no video stream)."""
    path = os.fspath(path)
    with av.open(path, mode="w") as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        samples = (np.sin(np.arange(int(seconds * rate)) * 0.05) * 8000).astype(np.int16)[None, :]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = rate
        frame.pts = 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def reference_frames(path: str | os.PathLike[str]) -> list[np.ndarray]:
    """Every frame of the file's first video stream, decoded start to end by plain PyAV as RGB
    uint8 (no rotation applied)."""
    with av.open(os.fspath(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def keyframe_indices(path: str | os.PathLike[str]) -> list[int]:
    """Presentation-order indices of the keyframes (for checking what a test file holds)."""
    with av.open(os.fspath(path)) as container:
        packets: list[Any] = [p for p in container.demux(video=0) if p.size]
    order = sorted(range(len(packets)), key=lambda k: packets[k].pts)
    return [rank for rank, k in enumerate(order) if packets[k].is_keyframe]
