"""Patches made on the GPU from the resized uint8 pixels are bit-identical to the host's (which
match transformers), for every image mode and size the preprocessing tests cover, alone and in
packs of mixed sizes, for the patch-14 (CLIP mean) and patch-16 (0.5 mean) configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmpipe.vision.preprocess import ImageProcessorConfig, ImageSize, patches_on_device, preprocess_image
from PIL import Image

from mmpipe.inputs import load_image
from tests.helpers import HostKernels, random_image

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
QWEN25 = ImageProcessorConfig(min_pixels=3136, max_pixels=1003520)
QWEN3 = ImageProcessorConfig(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, min_pixels=4096,
                             max_pixels=1003520)
SIZES = [(300, 10), (10, 300), (6000, 4000), (333, 517), (641, 479), (4000, 30), (30, 4000), (28, 28), (56, 84),
         (1, 150)]


def _modes() -> list[Image.Image]:
    rgba = np.asarray(random_image(123, 77, seed=9).convert("RGBA")).copy()
    rgba[::3, ::2, 3] = 0
    base = Image.fromarray(rgba, "RGBA")
    images = [base] + [base.convert(mode) for mode in ("LA", "L", "1", "CMYK", "P")]
    images.append(Image.fromarray((np.linspace(0, 65535, 90 * 60).reshape(60, 90)).astype(np.uint16)))
    return images


@pytest.mark.parametrize("cfg", [QWEN25, QWEN3], ids=["patch14", "patch16"])
@pytest.mark.parametrize("width,height", SIZES)
def test_gpu_patches_equal_host_patches(cfg, width, height):
    image = preprocess_image(load_image(random_image(width, height, seed=width + 3 * height)), cfg)
    gpu = patches_on_device([image], CUDA)
    assert gpu.dtype == torch.float32 and gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), image.pixel_values)


@pytest.mark.parametrize("cfg", [QWEN25, QWEN3], ids=["patch14", "patch16"])
def test_gpu_patches_equal_host_patches_for_every_mode(cfg):
    for source in _modes():
        image = preprocess_image(load_image(source), cfg)
        assert torch.equal(patches_on_device([image], CUDA).cpu(), image.pixel_values), source.mode


@pytest.mark.parametrize("cfg", [QWEN25, QWEN3], ids=["patch14", "patch16"])
def test_a_pack_of_mixed_sizes_equals_the_images_in_order(cfg):
    sources = [random_image(w, h, seed=w * h) for w, h in SIZES[:6]]
    images = [preprocess_image(load_image(s), cfg) for s in sources]
    images.append(preprocess_image(load_image(sources[3]), cfg.with_size(ImageSize(resized_height=64,
                                                                                    resized_width=256))))
    patches_on_device(images[:1], CUDA)  # the normalisation's constants are made once, on first use
    with HostKernels() as host:  # the pack's bytes are staged by numpy (torch's cat wakes OpenMP)
        pack = patches_on_device(images, CUDA)
    assert host.calls == []
    assert torch.equal(pack.cpu(), torch.cat([im.pixel_values for im in images]))
