"""Image preprocessing for Qwen-VL vision encoders.

Resize to a multiple of patch*merge within the checkpoint's pixel limits (Pillow bicubic on
uint8, exactly as transformers' `Qwen2VLImageProcessorPil` does) on the host; then rescale,
normalise, and cut into patches laid out merge-block by merge-block (`patches [N, C*T*P*P]` and
`grid_thw`) where the encoder runs: one kernel on CUDA over the uint8 bytes
(`patches_on_device`, `mmpipe.kernels.patchify`), transformers' arithmetic on the host. With
`image_decode="gpu"` a JPEG file's pixels are decoded and resized on the GPU instead
(`mmpipe.vision.gpu_decode`), and only then patchified the same way.

One image may ask for its own size (`ImageSize`: the `min_pixels`, `max_pixels`,
`resized_height` and `resized_width` keys of Qwen's `qwen_vl_utils.fetch_image`);
`ImageProcessorConfig.with_size` turns them into the config that image is preprocessed with, and
`resized_size` computes the size (by Qwen's helper's rule, `fetch_size`, for those keys).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmpipe.errors import CheckpointError, InputError
from mmpipe.kernels import triton
from mmpipe.kernels.patchify import patchify, patchify_reference

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# qwen_vl_utils' limits when an image names no min_pixels / max_pixels (IMAGE_MIN_TOKEN_NUM and
# IMAGE_MAX_TOKEN_NUM there): in merged tokens, so in pixels they scale with factor**2.
HELPER_MIN_TOKENS = 4
HELPER_MAX_TOKENS = 16384
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageSize:
    """One image's own size, in the keys of Qwen's `qwen_vl_utils.fetch_image`: `min_pixels` /
    `max_pixels` (the area limits for this image), or `resized_height` and `resized_width`
    together (about this size: each side rounded to the nearest multiple of patch*merge). Every
    value is a positive whole number; the two ways cannot be mixed."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    resized_height: int | None = None
    resized_width: int | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InputError(f"{field.name} must be a positive whole number, got {value!r}")
            object.__setattr__(self, field.name, int(value))  # numpy integers become ints
        if (self.resized_height is None) != (self.resized_width is None):
            given, missing = (("resized_height", "resized_width") if self.resized_width is None
                              else ("resized_width", "resized_height"))
            raise InputError(f"{given} needs {missing} too (the two give the size together)")
        if self.resized_height is not None and (self.min_pixels is not None or self.max_pixels is not None):
            raise InputError("resized_height/resized_width fix the size: give them or min_pixels/max_pixels, "
                             "not both")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise InputError(f"min_pixels={self.min_pixels} is above max_pixels={self.max_pixels}")

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, field.name) is None for field in fields(self))


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
    # Set per image by `with_size`, never by a checkpoint: the exact (height, width) to resize
    # to (resized_height / resized_width), and whether min/max_pixels become a size by
    # qwen_vl_utils' rule ("qwen_vl_utils": an image's own keys) or transformers' ("transformers").
    target_size: tuple[int, int] | None = None
    size_rule: str = "transformers"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_limits(self, min_pixels: int | None = None, max_pixels: int | None = None,
                    whose: str = "the checkpoint's") -> ImageProcessorConfig:
        """These pixel limits for every image (None keeps this config's value), by transformers'
        rule, as `AutoProcessor.from_pretrained(..., min_pixels=, max_pixels=)` sets them.
        `whose` names this config's limits in the error when the pair ends up inverted."""
        ImageSize(min_pixels=min_pixels, max_pixels=max_pixels)  # each value checked
        return replace(self, **_limits(self, min_pixels, max_pixels, whose))

    def with_size(self, size: ImageSize | None) -> ImageProcessorConfig:
        """The config one image is preprocessed with, given its own size keys (None or an empty
        `ImageSize`: this config). An image's min_pixels / max_pixels replace this config's
        (a key it leaves out keeps this config's value) and round by qwen_vl_utils' rule;
        resized_height and resized_width fix the size at `fetch_size(resized_height,
        resized_width, factor)` with the helper's own limits, whatever this config's are."""
        if size is None or size.is_empty:
            return self
        if size.resized_height is not None and size.resized_width is not None:
            return replace(self, target_size=fetch_size(size.resized_height, size.resized_width, self.factor))
        return replace(self, size_rule="qwen_vl_utils",
                       **_limits(self, size.min_pixels, size.max_pixels, "the pipeline's"))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ImageProcessorConfig:
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
    def from_dir(cls, path: str) -> ImageProcessorConfig:
        for name in ("preprocessor_config.json", "processor_config.json"):
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file) as handle:
                    return cls.from_dict(json.load(handle))
        raise CheckpointError(f"{path}: no preprocessor_config.json (needed for image preprocessing)")


def _limits(cfg: ImageProcessorConfig, min_pixels: int | None, max_pixels: int | None,
            whose: str) -> dict[str, int]:
    low = cfg.min_pixels if min_pixels is None else min_pixels
    high = cfg.max_pixels if max_pixels is None else max_pixels
    if low > high:
        if min_pixels is None:
            raise InputError(f"max_pixels={high} is below {whose} min_pixels={low}; give min_pixels too")
        raise InputError(f"min_pixels={low} is above {whose} max_pixels={high}; give max_pixels too")
    return {"min_pixels": low, "max_pixels": high}


@dataclass
class PreprocessedImage:
    """One image ready for the vision encoder: the resized uint8 pixels and how they become patches.

    The float patches are made where the encoder runs (`patches_on_device`: one kernel on CUDA,
    so only the uint8 bytes cross to the GPU); `pixel_values` makes them on the host, the
    reference (transformers' arithmetic)."""

    # [H, W, C] uint8, resized, or a video's frame group [T, H, W, C]; None: a JPEG the GPU decodes
    pixels: torch.Tensor | None
    grid_thw: tuple[int, int, int]  # in patches
    merge_size: int
    key: str = ""  # content hash: same key, same pixel values (the encoder cache's key)
    cfg: ImageProcessorConfig = ImageProcessorConfig()  # patch layout and normalisation
    # The all-GPU path (`mmpipe.vision.gpu_decode`): the encoded file, its name for errors, and
    # its (height, width) before resizing.
    jpeg: bytes | None = None
    source: str = ""
    source_size: tuple[int, int] = (0, 0)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """Language-model tokens this image becomes after the patch merger."""
        return self.num_patches // (self.merge_size * self.merge_size)

    @property
    def pixel_values(self) -> torch.Tensor:
        """Float32 patches [t*h*w, C*T*P*P], merge-block order, made on the host."""
        cfg = self.cfg
        return patchify_reference(self.pixels, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size,
                                  cfg.rescale_factor, cfg.image_mean, cfg.image_std)


def _layout(cfg: ImageProcessorConfig) -> tuple[Any, ...]:
    return (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size, cfg.rescale_factor, cfg.image_mean,
            cfg.image_std)


def patches_on_device(images: Sequence[PreprocessedImage], device: torch.device) -> torch.Tensor:
    """The float32 patches of a pack of images, [sum of patches, C*T*P*P] on `device`, in order.
    On CUDA the uint8 pixels go over in one copy from pinned memory (queued: the host does not
    wait for the GPU) and one kernel rescales, normalises and patchifies them, bit-identical to
    `pixel_values`; elsewhere each image's `pixel_values`. JPEG files of the all-GPU path are
    decoded and resized on the device first (there the host waits for each decode)."""
    if not images:
        raise ValueError("patches_on_device: no images")
    cfg = images[0].cfg
    if any(_layout(im.cfg) != _layout(cfg) for im in images[1:]):
        raise ValueError("patches_on_device: the images of one pack must share patch size and normalisation")
    if device.type != "cuda" or triton is None:
        if any(im.pixels is None for im in images):
            raise ValueError("patches_on_device: JPEG files decoded on the GPU need a CUDA device")
        return torch.cat([im.pixel_values for im in images]).to(device)
    if any(im.pixels is None for im in images):
        from mmpipe.vision.gpu_decode import pixels_on_device

        pixels = pixels_on_device(images, device)
    else:
        pixels = [im.pixels for im in images]
    channels = pixels[0].shape[-1]
    table = np.zeros((len(images), 6), dtype=np.int64)
    offset = rows = 0
    for i, (im, p) in enumerate(zip(images, pixels)):
        _, gh, gw = im.grid_thw
        group = p.dim() == 4  # a video's frame group [T, H, W, C]
        table[i] = (offset, gh, gw, rows, p[0].numel() if group else 0, int(group))
        offset += p.numel()
        rows += gh * gw
    # One pinned buffer: the table's bytes first (8-byte aligned), then the pixels on the host.
    host = [p for p in pixels if not p.is_cuda]
    if any(p.dtype != torch.uint8 for p in host):  # the table's offsets count bytes
        raise ValueError("patches_on_device: an image's resized pixels are not uint8")
    head = table.nbytes
    pinned = torch.empty(head + sum(p.numel() for p in host), dtype=torch.uint8, pin_memory=True)
    # numpy copies, not torch.cat: torch's copy of megabytes fans out to its OpenMP threads, which
    # then spin on every core for a while after each pack (whole cores per captioning run).
    staging = pinned.numpy()
    staging[:head] = table.view(np.uint8).reshape(-1)
    start = head
    for p in host:
        staging[start:start + p.numel()] = p.numpy().reshape(-1)
        start += p.numel()
    on_device = pinned.to(device, non_blocking=True)
    flat = on_device[head:]
    if len(host) < len(pixels):  # some were decoded on the device: one buffer, in pack order
        parts, start = [], 0
        for p in pixels:
            if p.is_cuda:
                parts.append(p.reshape(-1))
            else:
                parts.append(flat[start:start + p.numel()])
                start += p.numel()
        flat = torch.cat(parts)
    constants = _constants(cfg, channels, device)
    return patchify(flat, on_device[:head].view(torch.int64).view(len(images), 6), rows,
                    max(im.num_patches for im in images), cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size,
                    channels, *constants)


_CONSTANTS: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _constants(cfg: ImageProcessorConfig, channels: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rescale factor (float64), and the mean and std [2, C] on `device`: row 0 rounded to
    float32 as the host rounds them (images), row 1 those times 1/rescale in float32 (the video
    processors' folded normalisation), made once per normalisation and device."""
    key = (_layout(cfg), channels, str(device))
    if key not in _CONSTANTS:
        mean = torch.tensor(cfg.image_mean[:channels], dtype=torch.float64).to(torch.float32)
        std = torch.tensor(cfg.image_std[:channels], dtype=torch.float64).to(torch.float32)
        unscale = 1.0 / cfg.rescale_factor
        _CONSTANTS[key] = (torch.tensor([cfg.rescale_factor], dtype=torch.float64, device=device),
                           torch.stack([mean, mean * unscale]).to(device), torch.stack([std, std * unscale]).to(device))
    return _CONSTANTS[key]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target size: both sides multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible (the Qwen2-VL rule, as transformers' processor
    computes it: a side shorter than factor/2 first rounds to 0, and then the min_pixels branch
    sizes both sides again)."""
    return _resize_rule(height, width, factor, min_pixels, max_pixels, at_least_one_factor=False)


def fetch_size(height: int, width: int, factor: int, min_pixels: int | None = None,
               max_pixels: int | None = None) -> tuple[int, int]:
    """The size Qwen's helper (`qwen_vl_utils.vision_process.smart_resize`, used by its
    `fetch_image`) gives: the rule above, except that each side first rounds to at least one
    `factor`, and with the helper's own limits (HELPER_MIN_TOKENS and HELPER_MAX_TOKENS merged
    tokens) where none are given. Where the helper's downscale branch floors a side to 0 (it then
    fails to resize) a side keeps one `factor`, as its April 2025 version and transformers do."""
    min_pixels = HELPER_MIN_TOKENS * factor * factor if min_pixels is None else min_pixels
    max_pixels = HELPER_MAX_TOKENS * factor * factor if max_pixels is None else max_pixels
    if min_pixels > max_pixels:
        raise InputError(f"min_pixels={min_pixels} is above max_pixels={max_pixels}")
    return _resize_rule(height, width, factor, min_pixels, max_pixels, at_least_one_factor=True)


def _resize_rule(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 at_least_one_factor: bool) -> tuple[int, int]:
    if height <= 0 or width <= 0:
        raise InputError(f"image of size {width}x{height} has no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InputError(f"image of size {width}x{height}: aspect ratio {max(height, width) / min(height, width):.0f}"
                         f":1 exceeds the model's limit of {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if at_least_one_factor:
        h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
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
    """Resize one RGB image (Pillow, on the calling thread); the patches are made where the
    encoder runs (`patches_on_device`)."""
    if image.mode != "RGB":
        raise InputError(f"preprocess_image expects an RGB image, got mode {image.mode}")
    height, width = resized_size(image.height, image.width, cfg)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=cfg.resample)
    array = np.array(image, dtype=np.uint8)  # [H, W, C], a writable copy
    return PreprocessedImage(torch.from_numpy(array), _grid(height, width, cfg), cfg.merge_size,
                             content_key(array, cfg), cfg)


def resized_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """The (height, width) an image of this size is resized to under `cfg`."""
    if cfg.target_size is not None:
        return cfg.target_size
    if cfg.size_rule == "qwen_vl_utils":
        return fetch_size(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if cfg.size_rule != "transformers":
        raise ValueError(f"ImageProcessorConfig.size_rule={cfg.size_rule!r}: use 'transformers' or 'qwen_vl_utils'")
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def content_key(resized: np.ndarray, cfg: ImageProcessorConfig) -> str:
    """Hash of the resized uint8 pixels and the normalisation: it fixes the preprocessed values
    exactly, and is a quarter of the bytes of the float32 patches."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((resized.shape, cfg)).encode())
    digest.update(np.ascontiguousarray(resized).data)
    return digest.hexdigest()


def _grid(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    return (1, height // cfg.patch_size, width // cfg.patch_size)
