"""Qwen's `qwen_vl_utils` (from PyPI) as the oracle for video sampling and sizing.

It imports torchvision, which has no CPU build to install here (PyPI's wheels need CUDA's
libraries). Where torchvision cannot be imported, the module is loaded with a stand-in for the
three torchvision names it binds at import: `transforms.functional.resize` computed as
torchvision's tensor `resize` computes a uint8 bicubic resize (float32 interpolate with
antialiasing, clamp, round), and nothing else. Every frame count, frame index, sample rate and
size then still comes from qwen_vl_utils' own code; the pixels are checked against the real
torchvision where it imports (the GPU machine).

Files are read through qwen_vl_utils' decord backend, with `decord` played by plain PyAV (every
frame decoded start to end; the frame count and the stream's average rate as decord reports
them), so the backend's own range, frame-count and index arithmetic runs.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from fractions import Fraction
from typing import Any

import av
import numpy as np
import torch
import torch.nn.functional as F


def real_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
        from torchvision.transforms import functional  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # a CUDA build without CUDA fails as any of these
        return False
    return True


class _Interpolation(enum.Enum):
    BICUBIC = "bicubic"


def _standin_resize(video: torch.Tensor, size: list[int], interpolation: Any, antialias: bool) -> torch.Tensor:
    assert interpolation is _Interpolation.BICUBIC and antialias and video.dtype == torch.uint8
    out = F.interpolate(video.to(torch.float32), size=size, mode="bicubic", align_corners=False, antialias=True)
    return out.clamp(0, 255).round().to(torch.uint8)


def _standin_torchvision() -> dict[str, types.ModuleType]:
    tv = types.ModuleType("torchvision")
    tv.__version__ = "0.0+standin"
    io = types.ModuleType("torchvision.io")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.resize = _standin_resize
    transforms.functional = functional
    transforms.InterpolationMode = _Interpolation
    tv.io, tv.transforms = io, transforms
    return {"torchvision": tv, "torchvision.io": io, "torchvision.transforms": transforms,
            "torchvision.transforms.functional": functional}


class _PyAVDecord:
    """The part of decord's `VideoReader` qwen_vl_utils uses, played by PyAV."""

    def __init__(self, path: str) -> None:
        with av.open(path) as container:
            stream = container.streams.video[0]
            self._fps = float(stream.average_rate or stream.guessed_rate)
            self._frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]

    def __len__(self) -> int:
        return len(self._frames)

    def get_avg_fps(self) -> float:
        return self._fps

    def get_batch(self, indices: list[int]) -> Any:
        batch = np.stack([self._frames[i] for i in indices])
        return types.SimpleNamespace(asnumpy=lambda: batch)


_LOADED: types.ModuleType | None = None


def vision_process() -> types.ModuleType:
    """`qwen_vl_utils.vision_process`, reading files through the PyAV-played decord backend."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    standins = {} if real_torchvision() else _standin_torchvision()
    saved = {name: sys.modules.get(name) for name in (*standins, "decord")}
    sys.modules.update(standins)
    sys.modules["decord"] = types.SimpleNamespace(VideoReader=_PyAVDecord)
    try:
        module = importlib.import_module("qwen_vl_utils.vision_process")
    finally:
        for name in standins:  # the stand-ins never outlive the import: transformers probes torchvision
            if saved[name] is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]
    module.get_video_reader_backend = lambda: "decord"
    _LOADED = module
    return module


def fetch_video(element: dict[str, Any], patch_size: int) -> tuple[torch.Tensor, dict[str, Any], float]:
    """(frames [T, C, H, W] float, metadata, sample fps) as qwen_vl_utils gives them."""
    vp = vision_process()
    saved = sys.modules.get("decord")
    sys.modules["decord"] = types.SimpleNamespace(VideoReader=_PyAVDecord)
    try:
        (video, metadata), sample_fps = vp.fetch_video(element, image_patch_size=patch_size,
                                                       return_video_sample_fps=True, return_video_metadata=True)
    finally:
        if saved is None:
            sys.modules.pop("decord", None)
        else:
            sys.modules["decord"] = saved
    return video, metadata, float(sample_fps)


def as_fraction(value: float) -> Fraction:
    return Fraction(value).limit_denominator(1_000_000)
