"""The all-GPU image path (`EngineConfig.image_decode="gpu"`): JPEG files decoded by nvJPEG and
resized on the GPU, for captioning jobs whose CPUs cannot keep up with Pillow.

On the host only a file's header is read (Pillow, lazily: format, size, mode, EXIF orientation),
which fixes the resized size and so the grid: requests are planned exactly as on the CPU path.
`deferred_jpeg` returns an image without pixels; they are made on the device when its pack is
encoded (`pixels_on_device`, called by `patches_on_device`): `torchvision.io.decode_jpeg` on the
GPU, then torchvision's antialiased resize, as transformers' torchvision-backed
`Qwen2VLImageProcessor` resizes (so this path matches that processor, not the Pillow one).

What nvJPEG cannot give exactly as Pillow presents the image stays on the Pillow path: not a
JPEG, not 3-component YCbCr colour (grayscale, CMYK, Adobe RGB-coded), an EXIF rotation, a
resample filter torchvision lacks for tensors, a file that does not end with its end-of-image
marker (truncated: Pillow's error, as on the CPU path; nvJPEG may decode what is there). A file
nvJPEG fails on (an unsupported coding) is decoded by Pillow where it failed, with a warning; one
Pillow cannot decode either gets the CPU path's error.

Streams. torchvision allocates the decoded frames on the current stream and nvJPEG writes them
from its own stream, ordered after nothing queued on ours: a block the allocator hands out may
still be read by queued kernels. So decoding runs on a stream of its own that carries nothing
else and is idle (synchronised) before every decode; the resized pixels are handed to the
caller's stream, which waits for the decode stream.
"""

from __future__ import annotations

import hashlib
import io
import logging
from typing import Any, Sequence

import torch
from mmpipe.vision.preprocess import ImageProcessorConfig, PreprocessedImage, preprocess_image, resized_size
from PIL import Image

from mmpipe.errors import InputError
from mmpipe.inputs import decode_encoded, describe_source
from mmpipe.kernels import triton

log = logging.getLogger("mmpipe")

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"
EXIF_ORIENTATION = 0x0112
# Pillow's resample filters that torchvision's resize has for tensors (InterpolationMode values).
GPU_RESAMPLE = {Image.Resampling.BICUBIC: "bicubic", Image.Resampling.BILINEAR: "bilinear"}
# Decoded (full-size) bytes per decode call: a pack of many large photos shrunk to few patches
# is decoded in parts, each part's frames freed once resized.
DECODE_BYTES = 256 << 20
MIN_TORCHVISION = (0, 19)  # decode_jpeg of a list of files on CUDA


def require_gpu_decode(device: torch.device) -> None:
    """Everything the GPU path needs, checked before the weights load: CUDA, Triton (the
    patchify kernel), torchvision with nvJPEG for this device (one tiny file decoded there)."""
    if device.type != "cuda":
        raise InputError(f"image_decode='gpu' needs a CUDA device; this pipeline runs on {device}")
    if triton is None:
        raise InputError("image_decode='gpu' needs Triton (the patchify kernel); install triton")
    try:
        import torchvision
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as exc:  # ImportError, or a build that does not match torch
        raise InputError(f"image_decode='gpu' needs torchvision built for this torch "
                         f"(pip install 'mmpipe[gpu-decode]'): {exc}") from exc
    version = tuple(int(part) for part in torchvision.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCHVISION:
        raise InputError(f"image_decode='gpu' needs torchvision >= {'.'.join(map(str, MIN_TORCHVISION))}, "
                         f"found {torchvision.__version__}")
    probe = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 90)).save(probe, format="JPEG")
    try:
        decode_jpeg([torch.frombuffer(bytearray(probe.getvalue()), dtype=torch.uint8)], mode=ImageReadMode.RGB,
                    device=device)
    except RuntimeError as exc:  # e.g. a torchvision built without nvJPEG
        raise InputError(f"image_decode='gpu': torchvision cannot decode JPEG files on {device} ({exc})") from exc


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
            adobe_rgb = header.info.get("adobe_transform") == 0  # channels stored as RGB, not YCbCr
    except Exception:  # unreadable header: the Pillow path reports it as it always does
        return None
    if fmt != "JPEG" or mode != "RGB" or orientation != 1 or adobe_rgb:
        return None
    source_size = (height, width)
    height, width = resized_size(height, width, cfg)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(("nvjpeg", height, width, cfg)).encode())
    digest.update(data)
    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    return PreprocessedImage(None, grid, cfg.merge_size, digest.hexdigest(), cfg, jpeg=data,
                             source=describe_source(source), source_size=source_size)


_streams: dict[int, torch.cuda.Stream] = {}


def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


def pixels_on_device(images: Sequence[PreprocessedImage], device: torch.device) -> list[torch.Tensor]:
    """Each image's resized [H, W, C] uint8 pixels: a deferred JPEG's decoded and resized on
    `device` (ready for the current stream), any other's as they are (on the host). The host
    waits for each decode (nvJPEG's own synchronisation). Raises the Pillow path's
    `ImageLoadError` for a file neither nvJPEG nor Pillow decodes, `torch.OutOfMemoryError` when
    the decoded frames do not fit."""
    made: dict[int, torch.Tensor] = {}
    deferred = [im for im in images if im.pixels is None]
    caller = torch.cuda.current_stream(device)
    stream = _decode_stream(device)
    with torch.cuda.stream(stream):
        for part in _parts(deferred):
            stream.synchronize()  # every block this stream's pool hands out is idle
            for im, chw in zip(part, _decode(part, device)):
                pixels = _resize(im, chw) if chw is not None else _pillow(im)
                if pixels.is_cuda:
                    pixels.record_stream(caller)  # freed once the caller's queued work is done
                made[id(im)] = pixels
    caller.wait_stream(stream)
    return [made.get(id(im), im.pixels) for im in images]


def _parts(deferred: Sequence[PreprocessedImage]) -> list[list[PreprocessedImage]]:
    parts: list[list[PreprocessedImage]] = [[]]
    total = 0
    for im in deferred:
        size = 3 * im.source_size[0] * im.source_size[1]
        if parts[-1] and total + size > DECODE_BYTES:
            parts.append([])
            total = 0
        parts[-1].append(im)
        total += size
    return parts if parts[0] else []


def _decode(part: Sequence[PreprocessedImage], device: torch.device) -> list[torch.Tensor | None]:
    """The part's frames [3, H, W] on `device`; None for a file nvJPEG cannot decode."""
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = [torch.frombuffer(bytearray(im.jpeg), dtype=torch.uint8) for im in part]
    try:
        return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
    except RuntimeError as exc:  # one file nvJPEG cannot take fails the call: each alone
        _raise_if_out_of_memory(exc)
    frames: list[torch.Tensor | None] = []
    for im, data in zip(part, encoded):
        try:
            frames.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError as exc:
            _raise_if_out_of_memory(exc)
            log.warning("image %s: nvJPEG cannot decode it (%s); decoding it with Pillow", im.source,
                        str(exc).splitlines()[0])
            frames.append(None)
    return frames


def _raise_if_out_of_memory(exc: RuntimeError) -> None:
    """torchvision re-raises an allocation failure as a plain RuntimeError: out of memory is the
    engine's to handle (the pack retried one image at a time), not a reason for Pillow."""
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        raise torch.OutOfMemoryError(str(exc)) from exc


def _resize(im: PreprocessedImage, chw: torch.Tensor) -> torch.Tensor:
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as tvf

    height, width = im.grid_thw[1] * im.cfg.patch_size, im.grid_thw[2] * im.cfg.patch_size
    if tuple(chw.shape[1:]) != (height, width):
        chw = tvf.resize(chw, [height, width], interpolation=InterpolationMode(GPU_RESAMPLE[im.cfg.resample]),
                         antialias=True)
    return chw.permute(1, 2, 0)


def _pillow(im: PreprocessedImage) -> torch.Tensor:
    """Pillow's pixels for a file nvJPEG could not decode (on the host), or the CPU path's error."""
    return preprocess_image(decode_encoded(im.jpeg, None, name=im.source), im.cfg).pixels
