"""Image preprocessing for Qwen-VL vision encoders.

Resize to a multiple of patch*merge within the checkpoint's pixel limits (Pillow bicubic on
uint8, exactly as transformers' `Qwen2VLImageProcessorPil` does), rescale, normalise, and cut
into patches laid out merge-block by merge-block: `patches [N, C*T*P*P]` and `grid_thw`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmpipe.errors import CheckpointError, InputError

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ImageProcessorConfig":
        cfg = cfg.get("image_processor", cfg)  # processor_config.json nests it
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", cls.min_pixels)))
        max_pixels = cfg.get("max_pixels", size.get("longest_edge", size.get("max_pixels", cls.max_pixels)))
        if not cfg.get("do_rescale", True):
            raise CheckpointError("preprocessor config: do_rescale=false is not supported")
        if not cfg.get("do_normalize", True) or not cfg.get("do_resize", True):
            raise CheckpointError("preprocessor config: do_normalize/do_resize=false are not supported")
        return cls(
            patch_size=int(cfg.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", cls.merge_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(v) for v in cfg.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(float(v) for v in cfg.get("image_std", _CLIP_STD)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
        )

    @classmethod
    def from_dir(cls, path: str) -> "ImageProcessorConfig":
        for name in ("preprocessor_config.json", "processor_config.json"):
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file) as handle:
                    return cls.from_dict(json.load(handle))
        raise CheckpointError(f"{path}: no preprocessor_config.json (needed for image preprocessing)")


@dataclass
class PreprocessedImage:
    """One image ready for the vision encoder."""

    pixel_values: torch.Tensor  # [t*h*w, C*T*P*P] float32, merge-block order
    grid_thw: tuple[int, int, int]  # in patches
    merge_size: int
    key: str = ""  # content hash: same key, same pixel values (the encoder cache's key)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """Language-model tokens this image becomes after the patch merger."""
        return self.num_patches // (self.merge_size * self.merge_size)



def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target size: both sides multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible (the Qwen2-VL rule)."""
    if height <= 0 or width <= 0:
        raise InputError(f"image of size {width}x{height} has no pixels")
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"image of size {width}x{height}: aspect ratio "
                         f"{max(height, width) / min(height, width):.0f}:1 exceeds the model's limit of 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_image(image: Image.Image, cfg: ImageProcessorConfig) -> PreprocessedImage:
    """Resize, normalise and patchify one RGB image."""
    if image.mode != "RGB":
        raise InputError(f"preprocess_image expects an RGB image, got mode {image.mode}")
    height, width = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=cfg.resample)
    array = np.asarray(image, dtype=np.uint8)  # [H, W, C]
    pixels = torch.from_numpy(array.copy())
    scale = torch.tensor([cfg.rescale_factor] * 3, dtype=torch.float64)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float64)
    std = torch.tensor(cfg.image_std, dtype=torch.float64)
    # Same arithmetic as transformers: rescale in float64, cast, then normalise in float32.
    values = (pixels.to(torch.float64) * scale).to(torch.float32)
    values = (values - mean.to(torch.float32)) / std.to(torch.float32)
    key = content_key(array, cfg)
    return PreprocessedImage(patchify(values.permute(2, 0, 1), cfg), _grid(height, width, cfg), cfg.merge_size, key)


def content_key(resized: np.ndarray, cfg: ImageProcessorConfig) -> str:
    """Hash of the resized uint8 pixels and the normalisation: it fixes the preprocessed values
    exactly, and is a quarter of the bytes of the float32 patches."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((resized.shape, cfg)).encode())
    digest.update(np.ascontiguousarray(resized).data)
    return digest.hexdigest()


def patchify(chw: torch.Tensor, cfg: ImageProcessorConfig) -> torch.Tensor:
    """[C, H, W] -> [N, C*T*P*P], patches grouped by merge block (row-major blocks)."""
    channels, height, width = chw.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    x = chw.reshape(channels, gh // m, m, p, gw // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # a still image repeats over time
    return x.reshape(gh * gw, channels * t * p * p).contiguous()


def _grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    return (1, height // cfg.patch_size, width // cfg.patch_size)
