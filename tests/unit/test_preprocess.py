"""Preprocessing equals transformers' Qwen2VLImageProcessorPil: pixel values within 1e-5, grids exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmpipe.vision.preprocess import ImageProcessorConfig, preprocess_image, smart_resize
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmpipe.errors import InputError
from mmpipe.inputs import load_image
from tests.helpers import png_bytes, random_image

REFERENCE = Qwen2VLImageProcessorPil()  # published Qwen2.5-VL limits: 3136 .. 1003520 pixels
CONFIG = ImageProcessorConfig.from_dict(REFERENCE.to_dict())


def compare(image: Image.Image, reference_input: Image.Image | None = None,
            reference: Qwen2VLImageProcessorPil = REFERENCE, config: ImageProcessorConfig = CONFIG) -> None:
    ours = preprocess_image(load_image(image), config)
    ref = reference(images=[reference_input or image], return_tensors="pt")
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert (ours.pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("width,height", [
    (300, 10), (10, 300),  # tiny and thin
    (6000, 4000),  # huge: shrunk to max_pixels
    (333, 517), (641, 479),  # odd
    (4000, 30), (30, 4000),  # extreme aspect ratio (133:1)
    (28, 28), (56, 84), (1, 150),
])
def test_sizes_match_transformers(width, height):
    compare(random_image(width, height, seed=width * 7 + height))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "1", "CMYK", "P"])
def test_modes_match_transformers(mode):
    """transformers converts these itself (alpha over white, like mmpipe); both must agree."""
    rgba = np.asarray(random_image(123, 77, seed=9).convert("RGBA")).copy()
    rgba[::3, ::2, 3] = 0
    rgba[1::3, ::2, 3] = 100
    image = Image.fromarray(rgba, "RGBA").convert(mode) if mode != "RGBA" else Image.fromarray(rgba, "RGBA")
    compare(image)


def test_palette_with_transparency_matches_transformers():
    image = random_image(64, 48, seed=3).convert("P")
    reloaded = Image.open(__import__("io").BytesIO(png_bytes(image, transparency=5)))
    compare(reloaded)


def test_16_bit_image_is_rescaled_then_matches_on_the_converted_image():
    """transformers clips 16-bit values to 255 (a white image); mmpipe rescales to 8 bits first.
    On the converted image both agree exactly."""
    values = (np.linspace(0, 65535, 90 * 60).reshape(60, 90)).astype(np.uint16)
    image = Image.fromarray(values)
    converted = load_image(image)
    assert np.asarray(converted)[..., 0].max() == 255 and np.asarray(converted)[..., 0].min() == 0
    compare(image, reference_input=converted)


def test_custom_limits_from_checkpoint_config():
    reference = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    config = ImageProcessorConfig.from_dict(reference.to_dict())
    assert (config.min_pixels, config.max_pixels) == (28 * 28 * 4, 28 * 28 * 64)
    for size in [(500, 500), (20, 20), (1000, 90)]:
        compare(random_image(*size, seed=sum(size)), reference=reference, config=config)


def test_legacy_min_max_pixels_keys():
    config = ImageProcessorConfig.from_dict({"min_pixels": 100, "max_pixels": 5000, "patch_size": 16})
    assert (config.min_pixels, config.max_pixels, config.patch_size) == (100, 5000, 16)


def test_patches_are_grouped_by_merge_block():
    """Patch k of the output is the k-th patch in merge-block order, repeated over time."""
    config = ImageProcessorConfig(min_pixels=1, max_pixels=10**7)
    image = random_image(56, 28, seed=1)  # 2 x 4 patches -> 1 x 2 merge blocks
    out = preprocess_image(image, config)
    assert out.grid_thw == (1, 2, 4)
    values = (np.asarray(image, dtype=np.float32) / 255 - np.array(config.image_mean)) / np.array(config.image_std)
    patch = lambda r, c: values[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].transpose(2, 0, 1)  # noqa: E731
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    for k, (r, c) in enumerate(order):
        got = out.pixel_values[k].view(3, 2, 14, 14)
        assert np.allclose(got[:, 0].numpy(), patch(r, c), atol=1e-5)
        assert torch.equal(got[:, 0], got[:, 1])


def _reference_smart_resize():
    """transformers' Qwen2-VL `smart_resize` (the module needs torchvision; its PIL twin holds a
    verbatim copy, "Copied from transformers.models.qwen2_vl.image_processing_qwen2_vl")."""
    try:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference
    return reference


DOWNSCALE_SIZES = [(1000, 1000), (1920, 1080), (1080, 1920), (6000, 4000), (4032, 3024), (1280, 720),
                   (800, 600), (640, 480), (3000, 100), (100, 3000), (333, 517)]


@pytest.mark.parametrize("max_pixels", [28 * 28 * 1280, 28 * 28 * 256, 28 * 28 * 64])
def test_smart_resize_downscale_matches_transformers(max_pixels):
    """Above max_pixels transformers floors each side to the factor (so the area stays within
    the limit); rounding instead gives other grids, e.g. 1000x1000 -> 1008x1008 at the published
    limit (over it) where transformers gives 980x980, and 1920x1080 -> 1344x756, not 1316x728."""
    reference = _reference_smart_resize()
    checked = 0
    for width, height in DOWNSCALE_SIZES:
        if round(height / 28) * round(width / 28) * 28 * 28 <= max_pixels:
            continue  # not the downscale branch at this limit
        ours = smart_resize(height, width, 28, 56 * 56, max_pixels)
        theirs = reference(height, width, factor=28, min_pixels=56 * 56, max_pixels=max_pixels)
        assert ours == tuple(theirs), (width, height, max_pixels)
        assert ours[0] * ours[1] <= max_pixels and ours[0] % 28 == 0 and ours[1] % 28 == 0
        checked += 1
    assert checked >= 5  # at the published limit 5 of the sizes are downscaled; at the smaller ones 10 or 11
    if max_pixels == 28 * 28 * 1280:  # the published limit: the sizes named above
        assert smart_resize(1000, 1000, 28, 56 * 56, max_pixels) == (980, 980)
        assert smart_resize(1080, 1920, 28, 56 * 56, max_pixels) == (728, 1316)


def test_full_hd_photo_matches_transformers():
    """1920x1080 is shrunk (floor, not round) to the same grid and pixels as transformers."""
    compare(random_image(1920, 1080, seed=5))


def test_extreme_aspect_ratio_is_a_clear_error():
    with pytest.raises(InputError, match="aspect ratio 250:1"):
        smart_resize(10, 2500, 28, 3136, 1003520)
    with pytest.raises(InputError, match="aspect ratio"):
        preprocess_image(random_image(2500, 10, seed=1), CONFIG)


def test_content_hash_tracks_pixels():
    a = preprocess_image(random_image(64, 64, seed=1), CONFIG)
    b = preprocess_image(random_image(64, 64, seed=1), CONFIG)
    c = preprocess_image(random_image(64, 64, seed=2), CONFIG)
    assert a.key == b.key != c.key and len(a.key) == 32
    other = ImageProcessorConfig.from_dict({**REFERENCE.to_dict(), "image_mean": [0.5, 0.5, 0.5]})
    assert preprocess_image(random_image(64, 64, seed=1), other).key != a.key
