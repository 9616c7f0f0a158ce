"""Image inputs of every kind and mode, and clear errors for bad ones."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from mmpipe.errors import ImageLoadError, InputError
from mmpipe.inputs import load_image, parse_conversation
from tests.helpers import png_bytes, random_image


def test_every_source_kind_gives_the_same_pixels(tmp_path):
    image = random_image(37, 23, seed=1)
    data = png_bytes(image)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    expected = np.asarray(image)
    for source in (str(path), path, data, bytearray(data), memoryview(data), uri, image, expected):
        out = load_image(source)
        assert out.mode == "RGB" and out.size == (37, 23)
        assert np.array_equal(np.asarray(out), expected)


def test_transparency_is_composited_on_white():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200  # red channel
    rgba[:2, :, 3] = 0  # top half fully transparent
    rgba[2:, :, 3] = 255
    out = np.asarray(load_image(Image.fromarray(rgba, "RGBA")))
    assert (out[:2] == 255).all()
    assert (out[2:] == [200, 0, 0]).all()
    la = Image.fromarray(np.stack([np.full((3, 3), 10, np.uint8), np.full((3, 3), 0, np.uint8)], -1), "LA")
    assert (np.asarray(load_image(la)) == 255).all()


def test_half_transparent_pixel_blends_with_white():
    rgba = np.array([[[0, 0, 0, 128]]], dtype=np.uint8)
    (value,) = set(np.asarray(load_image(Image.fromarray(rgba, "RGBA"))).reshape(-1).tolist())
    assert 125 <= value <= 128


def test_palette_with_transparency_via_png_bytes():
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([255, 0, 0] + [0, 0, 255] * 255)
    pal.putpixel((0, 0), 1)
    data = png_bytes(pal, transparency=0)  # index 0 (red) transparent
    out = np.asarray(load_image(data))
    assert (out[0, 0] == [0, 0, 255]).all()
    assert (out[1, 1] == 255).all()


@pytest.mark.parametrize("mode", ["L", "1", "CMYK", "P", "YCbCr", "I", "F"])
def test_other_modes_become_rgb(mode):
    out = load_image(random_image(20, 10, seed=2).convert(mode))
    assert out.mode == "RGB" and out.size == (20, 10)


def test_16_bit_grayscale_keeps_its_range():
    values = np.array([[0, 32768, 65535]], dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    out = np.asarray(load_image(png_bytes(image)))[..., 0]
    assert out.tolist() == [[0, 128, 255]]


def test_exif_orientation_is_applied():
    image = random_image(40, 20, seed=3)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif)
    assert load_image(buf.getvalue()).size == (20, 40)


def test_animated_gif_uses_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 255, 0)]]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    out = np.asarray(load_image(buf.getvalue()))
    assert out[..., 0].mean() > 200 and out[..., 1].mean() < 50


@pytest.mark.parametrize("source,fragment", [
    (b"", "empty"),
    (b"definitely not an image", "not a recognised image"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,plain", "not base64"),
    ("https://example.com/cat.png", "URLs are not fetched"),
    (12345, "unsupported input"),
    (np.zeros((4, 4), dtype=np.float32), "uint8"),
])
def test_bad_inputs_raise_clear_errors(source, fragment):
    with pytest.raises(ImageLoadError, match=fragment):
        load_image(source)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ImageLoadError, match=r"nope\.png'.*no such file"):
        load_image(str(tmp_path / "nope.png"))
    with pytest.raises(ImageLoadError, match="is a directory"):
        load_image(str(tmp_path))


def test_truncated_and_corrupt_files_name_the_input(tmp_path):
    data = png_bytes(random_image(64, 64, seed=4))
    path = tmp_path / "cut.png"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageLoadError, match="cut.png"):
        load_image(str(path))
    buf = io.BytesIO()
    random_image(64, 64, seed=5).save(buf, format="JPEG")
    with pytest.raises(ImageLoadError, match="bytes"):
        load_image(buf.getvalue()[:300])


def test_conversation_parsing_pulls_images_out_in_order():
    a, b = random_image(8, 8, seed=1), random_image(8, 8, seed=2)
    parsed = parse_conversation([
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "x"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": [{"type": "image", "image": b}]},
    ])
    assert parsed.images[0] is a and parsed.images[2] is b
    assert parsed.images[1].startswith("data:")
    assert parsed.template_messages[0]["content"][0] == {"type": "image"}


@pytest.mark.parametrize("conversation,fragment", [
    ({"role": "user", "content": "hi"}, "list of messages"),
    ([], "no messages"),
    ([{"content": "hi"}], "message 0: must be a dict with 'role'"),
    ([{"role": "user", "content": 5}], "'content' must be"),
    ([{"role": "user", "content": ["hi"]}], "part 0: parts must be dicts"),
    ([{"role": "user", "content": [{"type": "image"}]}], "needs 'image'"),
    ([{"role": "user", "content": [{"type": "audio", "audio": b""}]}], "unsupported part type 'audio'"),
])
def test_bad_conversations(conversation, fragment):
    with pytest.raises(InputError, match=fragment):
        parse_conversation(conversation)
