"""Reading one chat video into frames for the model (on a worker thread).

A file is probed for its frame count and rate, the frames to keep are picked by Qwen's rules
(`mmpipe.vision.video_sampling`), and only those are decoded, each resized as soon as it is decoded
(`mmpipe.vision.video_frames.resize_frame`), so host memory holds the small resized frames and a
frame or two in flight, whatever the video's length. A list of frames is read as
`qwen_vl_utils.fetch_video` (0.0.14) reads one: each frame decoded and sized as an image (Pillow
bicubic, the image size rule with an image's default limits, the part's own keys), padded to an
even count with its last frame, then all resized to the video's frame size. That helper sizes
such frames with twice the factor of an image (it passes its patch x merge factor where
`fetch_image` takes the patch size), so they first round to multiples of 2 x patch x merge; mmpipe
does the same, so its frames and tokens equal the reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmpipe.errors import InputError, VideoLoadError
from mmpipe.inputs import describe_source, load_image
from mmpipe.video_parts import ChatVideo
from mmpipe.video_reader import VideoFile
from mmpipe.vision.preprocess import ImageProcessorConfig, fetch_size
from mmpipe.vision.video_frames import PreprocessedVideo, resize_frame
from mmpipe.vision.video_sampling import FPS, frame_size, list_frame_count, sample_frames

BuildVideo = Callable[..., PreprocessedVideo]  # (frames, cfg, indices, video fps, sample fps)


def load_video(video: ChatVideo, cfg: ImageProcessorConfig, build: BuildVideo, threads: int = 1,
               decode: str = "cpu") -> PreprocessedVideo:
    """Decode, sample and resize one video; `build` (the family's `ModelSpec.preprocess_video`)
    cuts the frames into what the tower takes. `decode="gpu"`: NVDEC where the GPU and FFmpeg
    have it (the frames still come back to the host to be resized), else the CPU."""
    if video.is_frames:
        return _from_frames(video, cfg, build)
    options = video.options
    with VideoFile(video.source, threads=threads, device=decode) as file:
        info = file.info
        try:
            sample = sample_frames(options, info.total_frames, info.fps)
            size = frame_size(info.height, info.width, len(sample.indices), options, cfg.factor)
        except InputError as exc:
            raise VideoLoadError(f"video {describe_source(video.source)}: {exc}") from None
        frames = file.read(sample.indices, lambda frame: resize_frame(frame, size))
    return build(frames, cfg, sample.indices, sample.video_fps, sample.sample_fps)


def _from_frames(video: ChatVideo, cfg: ImageProcessorConfig, build: BuildVideo) -> PreprocessedVideo:
    options = video.options
    images = []
    for k, frame in enumerate(video.source):
        try:
            images.append(_as_image_frame(load_image(frame), options, 2 * cfg.factor))
        except InputError as exc:
            raise type(exc)(f"frame {k}: {exc}") from None
    if any(im.size != images[0].size for im in images):
        sizes = sorted({f"{im.width}x{im.height}" for im in images})
        raise InputError(f"the video's frames come out at different sizes ({', '.join(sizes)}); give frames of one "
                         "size, or resized_height and resized_width")
    count = list_frame_count(len(images))
    images += [images[-1]] * (count - len(images))
    size = frame_size(images[0].height, images[0].width, count, options, cfg.factor)
    frames = [resize_frame(np.array(im), size) for im in images]
    sample_fps = FPS if options.sample_fps is None else options.sample_fps
    return build(frames, cfg, list(range(count)), sample_fps, sample_fps)


def _as_image_frame(image: Image.Image, options: Any, factor: int) -> Image.Image:
    """qwen_vl_utils' `fetch_image` of one frame of a list: the image rule with the part's own
    keys, at `factor`."""
    if options.resized_height is not None:
        height, width = fetch_size(options.resized_height, options.resized_width, factor)
    else:
        height, width = fetch_size(image.height, image.width, factor, options.min_pixels, options.max_pixels)
    return image.resize((width, height), resample=Image.Resampling.BICUBIC)


def video_frames_tensor(video: PreprocessedVideo) -> torch.Tensor:
    """All sampled frames [frames, h, w, 3] uint8, in order (for tests and tools)."""
    return torch.cat([group.pixels for group in video.groups])
