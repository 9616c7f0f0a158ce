"""The all-GPU image path (`EngineConfig.image_decode="gpu"`): JPEG files decoded by nvJPEG and
resized on the GPU, for captioning jobs whose CPUs cannot keep up with Pillow.

On the host only a file's header is read (Pillow, lazily: format, size, mode, EXIF orientation),
which fixes the resized size and so the grid: requests are planned exactly as on the CPU path.
`deferred_jpeg` returns an image without pixels; they are made on the device when its pack is
encoded (`pixels_on_device`, called by `patches_on_device`): `torchvision.io.decode_jpeg` on the
GPU, then torchvision's antialiased resize, as transformers' torchvision-backed
`Qwen2VLImageProcessor` resizes (so this path matches that processor, not the Pillow one).

What nvJPEG cannot give exactly as Pillow presents the image stays on the Pillow path: not a
JPEG, not 3-component colour (grayscale, CMYK), an EXIF rotation, a resample filter torchvision
lacks for tensors, a file that does not end with its end-of-image marker (truncated: Pillow's
error, as on the CPU path; nvJPEG may decode what is there). A file nvJPEG fails on (corrupt, an unsupported coding) is decoded by Pillow
where it failed, so a corrupt file gets the same error as on the CPU path.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any, Sequence

import torch
from mmpipe.vision.preprocess import ImageProcessorConfig, PreprocessedImage, preprocess_image, resized_size
from PIL import Image

from mmpipe.errors import InputError
from mmpipe.inputs import decode_encoded

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"
EXIF_ORIENTATION = 0x0112


def require_torchvision() -> None:
    """The GPU path decodes with torchvision's nvJPEG binding; a clear error without it."""
    try:
        import torchvision.io  # noqa: F401
    except Exception as exc:  # ImportError, or a build that does not match torch
        raise InputError(f"image_decode='gpu' needs torchvision built for this torch ({exc})") from exc


# Pillow's resample filters that torchvision's resize has for tensors (InterpolationMode values).
GPU_RESAMPLE = {Image.Resampling.BICUBIC: "bicubic", Image.Resampling.BILINEAR: "bilinear"}


def deferred_jpeg(data: bytes, source: Any, cfg: ImageProcessorConfig) -> PreprocessedImage | None:
    """An image whose pixels the GPU will decode and resize, or None for the Pillow path (see
    the module docstring). `source`: the caller's source, named in a later decoding error."""
    if data[:3] != JPEG_MAGIC or cfg.resample not in GPU_RESAMPLE:
        return None
    if not data.rstrip(b"\x00").endswith(JPEG_END):  # truncated: Pillow reports it, as on the CPU path
        return None
    try:
        with Image.open(io.BytesIO(data)) as header:
            fmt, mode, (width, height) = header.format, header.mode, header.size
            orientation = header.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # unreadable header: the Pillow path reports it as it always does
        return None
    if fmt != "JPEG" or mode != "RGB" or orientation != 1:
        return None
    height, width = resized_size(height, width, cfg)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(("nvjpeg", height, width, cfg)).encode())
    digest.update(data)
    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    return PreprocessedImage(None, grid, cfg.merge_size, digest.hexdigest(), cfg, jpeg=data, source=source)


def pixels_on_device(images: Sequence[PreprocessedImage], device: torch.device) -> list[torch.Tensor]:
    """Each image's resized [H, W, C] uint8 pixels: a deferred JPEG's decoded and resized on
    `device`, any other's as they are (on the host). Raises the Pillow path's `ImageLoadError` for
    a file neither nvJPEG nor Pillow can decode."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as tvf

    deferred = [im for im in images if im.pixels is None]
    encoded = [torch.frombuffer(bytearray(im.jpeg), dtype=torch.uint8) for im in deferred]
    try:
        decoded: list[torch.Tensor | None] = list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:  # one file nvJPEG cannot take fails the batch: each alone
        decoded = []
        for data in encoded:
            try:
                decoded.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                decoded.append(None)
    made = {}
    for im, chw in zip(deferred, decoded):
        if chw is None:  # Pillow, here: its result, or the error the CPU path gives
            made[id(im)] = preprocess_image(decode_encoded(im.jpeg, im.source), im.cfg).pixels
            continue
        height, width = im.grid_thw[1] * im.cfg.patch_size, im.grid_thw[2] * im.cfg.patch_size
        if tuple(chw.shape[1:]) != (height, width):
            chw = tvf.resize(chw, [height, width], interpolation=InterpolationMode(GPU_RESAMPLE[im.cfg.resample]),
                              antialias=True)
        made[id(im)] = chw.permute(1, 2, 0)
    return [made.get(id(im), im.pixels) for im in images]
