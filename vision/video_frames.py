"""A sampled video made ready for the vision tower: its frames resized, then cut into frame groups.

Frames are resized as `qwen_vl_utils.fetch_video` resizes them (torchvision's bicubic resize with
antialiasing on uint8 frames: interpolate in float32, clamp, round), one frame at a time as the
decoder hands them over, so only the small resized frames are kept. The tower takes frames in
groups of `temporal_patch_size` (2) and attends within a group, so each group is prepared like an
image of grid (1, h, w) whose two temporal slices are two real frames (`PreprocessedImage` with
pixels [T, H, W, C]); the engine encodes, caches and places the groups as it does images, and a
long video splits into ViT packs at group boundaries. `PreprocessedVideo` keeps what the prompt
and the positions need: the grid, the frame indices, the file's frame rate and the sampled one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from mmpipe.vision.preprocess import ImageProcessorConfig, PreprocessedImage
from mmpipe.vision.video_sampling import group_timestamps, seconds_per_group

from mmpipe.errors import InputError


def resize_frame(frame: np.ndarray | torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """One uint8 RGB frame [H, W, 3] resized to `size` (height, width): [h, w, 3] uint8, as
    torchvision's `resize(..., BICUBIC, antialias=True)` computes it on a uint8 tensor."""
    image = torch.as_tensor(frame)
    if image.dtype != torch.uint8 or image.dim() != 3:
        raise InputError(f"a video frame must be uint8 [height, width, channels], got {image.dtype} "
                         f"{tuple(image.shape)}")
    if tuple(image.shape[:2]) == tuple(size):
        return image.contiguous()
    chw = image.permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    out = F.interpolate(chw, size=size, mode="bicubic", align_corners=False, antialias=True)
    out = out.clamp_(0, 255).round_().to(torch.uint8)
    return out[0].permute(1, 2, 0).contiguous()


@dataclass
class PreprocessedVideo:
    """A video ready for the engine: `groups` are what the tower encodes (in order); the rest fixes
    the prompt's tokens and positions."""

    groups: list[PreprocessedImage]
    frame_indices: list[int]  # which frames of the source were sampled (after padding to groups)
    video_fps: float  # the source's frame rate: Qwen3-VL's timestamps
    sample_fps: float  # sampled frames a second: Qwen2.5-VL's temporal positions
    temporal: int = 2

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        _, gh, gw = self.groups[0].grid_thw
        return (len(self.groups), gh, gw)

    @property
    def num_tokens(self) -> int:
        return sum(group.num_tokens for group in self.groups)

    @property
    def seconds_per_group(self) -> float:
        return seconds_per_group(self.sample_fps, self.temporal)

    @property
    def timestamps(self) -> list[float]:
        """Seconds at the middle of each group (Qwen3-VL writes them into the prompt)."""
        return group_timestamps(self.frame_indices, self.video_fps, self.temporal)

    @property
    def key(self) -> str:
        return "video:" + "|".join(group.key for group in self.groups)


def build_video(frames: Sequence[torch.Tensor], cfg: ImageProcessorConfig, frame_indices: Sequence[int],
                video_fps: float, sample_fps: float) -> PreprocessedVideo:
    """Resized uint8 frames [h, w, 3] (all one size, each side a multiple of patch x merge) ->
    frame groups. A count that is not a multiple of the temporal patch repeats the last frame, as
    transformers' video processors pad."""
    if not frames:
        raise InputError("a video needs at least one frame")
    height, width = frames[0].shape[:2]
    if any(tuple(f.shape) != tuple(frames[0].shape) for f in frames):
        raise InputError("a video's frames must all have one size")
    if height % cfg.factor or width % cfg.factor:
        raise ValueError(f"frames of {width}x{height} are not multiples of {cfg.factor}")
    temporal = cfg.temporal_patch_size
    frames = list(frames) + [frames[-1]] * (-len(frames) % temporal)
    indices = list(frame_indices) + [frame_indices[-1]] * (len(frames) - len(frame_indices))
    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    groups = []
    for start in range(0, len(frames), temporal):
        pixels = torch.stack(frames[start:start + temporal])  # [T, h, w, C]
        groups.append(PreprocessedImage(pixels, grid, cfg.merge_size, group_key(pixels, cfg), cfg))
    return PreprocessedVideo(groups, indices, float(video_fps), float(sample_fps), temporal)


def group_key(pixels: torch.Tensor, cfg: ImageProcessorConfig) -> str:
    """Hash of a frame group's pixels and normalisation: the encoder cache's key (a still image of
    the same pixels is normalised differently, so the tag keeps the two apart)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(("frames", tuple(pixels.shape), cfg)).encode())
    digest.update(pixels.contiguous().numpy().data)
    return digest.hexdigest()
