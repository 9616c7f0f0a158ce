"""Preprocessing equals transformers' Qwen2VLImageProcessorPil: pixel values within 1e-5, grids exact;
an image's own size keys (qwen_vl_utils' min_pixels / max_pixels / resized_height + resized_width)
give the sizes Qwen's helper gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmpipe.vision.preprocess import (
    ImageProcessorConfig,
    ImageSize,
    fetch_size,
    preprocess_image,
    smart_resize,
)
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


# ------------------------------------------------------------ an image's own size (qwen_vl_utils keys)

@pytest.mark.parametrize("width,height,min_pixels,max_pixels", [
    (640, 480, 3136, 28 * 28 * 64),  # shrunk: floor branch
    (300, 200, 28 * 28 * 300, 28 * 28 * 400),  # enlarged: ceil branch
    (333, 517, 28 * 28 * 100, 28 * 28 * 300),  # within: rounded
    (1920, 1080, 3136, 28 * 28 * 256),
    (50, 2000, 3136, 28 * 28 * 16),  # thin, shrunk
])
def test_per_image_min_max_pixels_match_transformers_with_the_same_limits(width, height, min_pixels, max_pixels):
    """An image's own min/max_pixels replace the config's: sizes, grids, token counts and pixel
    values are what transformers' processor gives with those limits."""
    reference = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    config = CONFIG.with_size(ImageSize(min_pixels=min_pixels, max_pixels=max_pixels))
    assert (config.min_pixels, config.max_pixels) == (min_pixels, max_pixels)
    image = random_image(width, height, seed=width + height)
    compare(image, reference=reference, config=config)
    grid = reference(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert preprocess_image(image, config).num_tokens == grid[1] * grid[2] // 4


def test_one_per_image_limit_keeps_the_configs_other_limit():
    config = CONFIG.with_size(ImageSize(max_pixels=28 * 28 * 64))
    assert (config.min_pixels, config.max_pixels) == (CONFIG.min_pixels, 28 * 28 * 64)
    config = CONFIG.with_size(ImageSize(min_pixels=28 * 28 * 300))
    assert (config.min_pixels, config.max_pixels) == (28 * 28 * 300, CONFIG.max_pixels)
    assert CONFIG.with_size(None) is CONFIG and CONFIG.with_size(ImageSize()) is CONFIG
    with pytest.raises(InputError, match="min_pixels=2000000 is above the pipeline's max_pixels=1003520; give max"):
        CONFIG.with_size(ImageSize(min_pixels=2_000_000))
    with pytest.raises(InputError, match="max_pixels=1000 is below the pipeline's min_pixels=3136; give min"):
        CONFIG.with_size(ImageSize(max_pixels=1000))


# Qwen's helper (qwen_vl_utils.vision_process.smart_resize): each side round(side / f) * f but at
# least f; above max_pixels beta = sqrt(h * w / max_pixels) and each side floor(side / beta / f) * f;
# below min_pixels beta = sqrt(min_pixels / (h * w)) and each side ceil(side * beta / f) * f. With
# resized_height / resized_width its limits are its own: 4 * f * f .. 16384 * f * f.
@pytest.mark.parametrize("resized,factor,expected", [
    # 300 / 28 = 10.71 -> 11 -> 308; 500 / 28 = 17.86 -> 18 -> 504; 155232 px is within 3136 .. 12845056
    ((300, 500), 28, (308, 504)),
    # Qwen3-VL (patch 16, merge 2): 300 / 32 = 9.375 -> 9 -> 288; 500 / 32 = 15.625 -> 16 -> 512
    ((300, 500), 32, (288, 512)),
    # 15 / 28 -> 1 -> 28, 40 / 28 -> 1 -> 28: 784 px < 3136, beta = sqrt(3136 / 600) = 2.286;
    # 15 * 2.286 / 28 = 1.22 -> 2 -> 56; 40 * 2.286 / 28 = 3.27 -> 4 -> 112
    ((15, 40), 28, (56, 112)),
    # 10 / 28 = 0.36 -> 0, kept at one factor (28); 600 / 28 = 21.4 -> 21 -> 588; 16464 px is within
    # (transformers' rule would take the min_pixels branch from 0 and give 28 x 448)
    ((10, 600), 28, (28, 588)),
    # 24M px > 12845056: beta = sqrt(24e6 / 12845056) = 1.3669; 4000 / 1.3669 / 28 = 104.5 -> 104 -> 2912;
    # 6000 / 1.3669 / 28 = 156.8 -> 156 -> 4368
    ((4000, 6000), 28, (2912, 4368)),
])
def test_resized_height_and_width_give_the_helpers_size(resized, factor, expected):
    config = ImageProcessorConfig(patch_size=factor // 2, merge_size=2, min_pixels=3136, max_pixels=200704)
    sized = config.with_size(ImageSize(resized_height=resized[0], resized_width=resized[1]))
    assert sized.target_size == expected
    assert fetch_size(*resized, factor) == expected
    out = preprocess_image(random_image(90, 70, seed=1), sized)  # the image's own size does not matter
    assert out.grid_thw == (1, expected[0] // (factor // 2), expected[1] // (factor // 2))
    assert out.num_tokens == (expected[0] // factor) * (expected[1] // factor)


def test_resized_image_is_resampled_once_to_the_exact_size():
    """The pixels are those of a bicubic resize straight to the target (308x504 is inside the
    default limits, so the plain config leaves that resized image as it is)."""
    image = random_image(333, 517, seed=2)
    ours = preprocess_image(image, CONFIG.with_size(ImageSize(resized_height=300, resized_width=500)))
    direct = preprocess_image(image.resize((504, 308), resample=Image.Resampling.BICUBIC), CONFIG)
    assert ours.grid_thw == direct.grid_thw == (1, 22, 36)
    assert torch.equal(ours.pixel_values, direct.pixel_values)


def test_per_image_limits_round_thin_sides_as_the_helper_does():
    """A side under half a factor: the helper keeps it at one factor (28 x 588 for 10 x 600);
    transformers' rule, kept for images without their own keys, gives 28 x 448."""
    image = random_image(600, 10, seed=4)
    assert preprocess_image(image, CONFIG).grid_thw == (1, 2, 32)
    own = CONFIG.with_size(ImageSize(min_pixels=CONFIG.min_pixels, max_pixels=CONFIG.max_pixels))
    assert own.size_rule == "qwen_vl_utils"
    assert preprocess_image(image, own).grid_thw == (1, 2, 42)


def test_the_downscale_floor_keeps_one_factor():
    """30 x 5000 under max_pixels=3136: beta = sqrt(150000 / 3136) = 6.92, 30 / 6.92 / 28 = 0.15
    floors to 0, kept at 28 (the helper's 0.0.14 would give 0 and fail to resize); 5000 / 6.92 / 28
    = 25.8 -> 25 -> 700."""
    assert fetch_size(30, 5000, 28, 3136, 3136) == (28, 700)
    with pytest.raises(InputError, match="aspect ratio 250:1"):
        fetch_size(10, 2500, 28)
    with pytest.raises(InputError, match="min_pixels=5000 is above max_pixels=4000"):
        fetch_size(100, 100, 28, 5000, 4000)


def test_pipeline_limits_keep_transformers_rule():
    config = CONFIG.with_limits(max_pixels=28 * 28 * 64)
    assert (config.min_pixels, config.max_pixels, config.size_rule) == (3136, 28 * 28 * 64, "transformers")
    reference = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 28 * 28 * 64})
    compare(random_image(600, 10, seed=4), reference=reference, config=config)  # a thin side: transformers'
    with pytest.raises(InputError, match="max_pixels=1000 is below the checkpoint's min_pixels=3136"):
        CONFIG.with_limits(max_pixels=1000)


def test_content_hash_tracks_the_size():
    image = random_image(200, 150, seed=3)
    plain = preprocess_image(image, CONFIG)
    small = preprocess_image(image, CONFIG.with_size(ImageSize(max_pixels=28 * 28 * 16)))
    again = preprocess_image(image, CONFIG.with_size(ImageSize(max_pixels=28 * 28 * 16)))
    fixed = preprocess_image(image, CONFIG.with_size(ImageSize(resized_height=300, resized_width=500)))
    assert len({plain.key, small.key, fixed.key}) == 3 and small.key == again.key
    assert small.num_tokens < plain.num_tokens < fixed.num_tokens


def test_a_patch_16_checkpoint_sizes_by_multiples_of_32(checkpoint_factory):
    """Qwen3-VL (patch 16, merge 2): the factor comes from the checkpoint's preprocessor config.
    resized 300x500 -> 288x512 (9.375 -> 9, 15.625 -> 16 multiples of 32): 18x32 patches, 9x16
    tokens; an image's own max_pixels gives transformers' size and pixels at that limit."""
    path = checkpoint_factory(family="qwen3_vl")
    config = ImageProcessorConfig.from_dir(path)
    assert (config.patch_size, config.factor) == (16, 32)
    out = preprocess_image(random_image(90, 70, seed=1), config.with_size(ImageSize(resized_height=300,
                                                                                    resized_width=500)))
    assert out.grid_thw == (1, 18, 32) and out.num_tokens == 9 * 16
    limits = {"shortest_edge": config.min_pixels, "longest_edge": 32 * 32 * 64}
    reference = Qwen2VLImageProcessorPil.from_pretrained(path, size=limits)
    compare(random_image(640, 480, seed=2), reference=reference,
            config=config.with_size(ImageSize(max_pixels=32 * 32 * 64)))


def test_an_image_is_kept_as_its_resized_uint8_pixels():
    """Only the resized bytes are held (and cross to the GPU); the float patches are made from them."""
    ours = preprocess_image(random_image(333, 517, seed=4), CONFIG)
    t, gh, gw = ours.grid_thw
    assert ours.pixels.dtype == torch.uint8 and tuple(ours.pixels.shape) == (gh * 14, gw * 14, 3)
    assert ours.pixel_values.shape == (t * gh * gw, 3 * 2 * 14 * 14)
    assert ours.pixel_values.element_size() * ours.pixel_values.numel() == 8 * ours.pixels.numel()


def test_host_patches_of_a_pack_are_each_images_patches_in_order():
    from mmpipe.vision.preprocess import patches_on_device

    images = [preprocess_image(random_image(w, h, seed=w), CONFIG) for w, h in ((333, 517), (56, 84), (641, 479))]
    pack = patches_on_device(images, torch.device("cpu"))
    assert torch.equal(pack, torch.cat([im.pixel_values for im in images]))
    with pytest.raises(ValueError, match="share patch size and normalisation"):
        other = preprocess_image(random_image(56, 84, seed=1), ImageProcessorConfig(image_mean=(0.5,) * 3))
        patches_on_device([images[0], other], torch.device("cpu"))
