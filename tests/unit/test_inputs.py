"""Image inputs of every kind and mode, and clear errors for bad ones."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from mmpipe import Pipeline, SamplingParams
from mmpipe.errors import ImageLoadError, InputError
from mmpipe.inputs import ImageSize, load_image, parse_conversation
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


@pytest.mark.parametrize("prefix", ["data:;base64,", "data:application/octet-stream;base64,",
                                    "data:application/octet-stream;name=a.png;base64,", "data:image/jpeg;base64,"])
def test_data_uris_without_an_image_type_give_the_files_pixels(tmp_path, prefix):
    """What clients send: no media type, the generic binary one (with a parameter), or an image
    type other than the payload's. Each loads the file's pixels, bare and inside a chat message."""
    image = random_image(29, 17, seed=5)
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(image))
    uri = prefix + base64.b64encode(path.read_bytes()).decode()
    expected = np.asarray(load_image(str(path)))
    assert np.array_equal(np.asarray(load_image(uri)), expected)
    parsed = parse_conversation([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": uri}}, {"type": "image", "base64": uri}]}])
    assert [np.array_equal(np.asarray(load_image(i.source)), expected) for i in parsed.images] == [True, True]


@pytest.mark.parametrize("media_type", ["text/plain", "application/json", "video/mp4"])
def test_a_data_uri_of_another_declared_type_is_refused_by_name(media_type):
    uri = f"data:{media_type};base64," + base64.b64encode(png_bytes(random_image(8, 8))).decode()
    with pytest.raises(ImageLoadError, match=f"media type '{media_type}', not an image"):
        load_image(uri)


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
    assert parsed.images[0].source is a and parsed.images[2].source is b
    assert parsed.images[1].source.startswith("data:")
    assert all(image.size is None for image in parsed.images)
    assert parsed.template_messages[0]["content"][0] == {"type": "image"}


@pytest.mark.parametrize("conversation,fragment", [
    ({"role": "user", "content": "hi"}, "list of messages"),
    ([], "no messages"),
    ([{"content": "hi"}], "message 0: must be a dict with 'role'"),
    ([{"role": "user", "content": 5}], "'content' must be"),
    ([{"role": "user", "content": ["hi"]}], "part 0: parts must be dicts"),
    ([{"role": "user", "content": [{"type": "image"}]}], "needs one source: 'image'"),
    ([{"role": "user", "content": [{"type": "audio", "audio": b""}]}], "unsupported part type 'audio'"),
])
def test_bad_conversations(conversation, fragment):
    with pytest.raises(InputError, match=fragment):
        parse_conversation(conversation)


# ------------------------------------------------ image parts as Qwen's and transformers' docs write them

def image_part(**keys):
    return [{"role": "user", "content": [{"type": "image", **keys}, {"type": "text", "text": "x"}]}]


def parsed_image(**keys):
    (image,) = parse_conversation(image_part(**keys)).images
    return image


def test_every_image_part_form_gives_the_same_pixels(tmp_path):
    """file:// URIs (percent-encoded: a space and a non-ASCII name), transformers' url / path /
    base64 keys: each reads the same pixels as the plain path."""
    image = random_image(37, 23, seed=6)
    data = png_bytes(image)
    path = tmp_path / "a b é.png"
    path.write_bytes(data)
    uri = path.as_uri()  # file:///.../a%20b%20%C3%A9.png
    assert "%20" in uri and "%C3%A9" in uri
    payload = base64.b64encode(data).decode()
    data_uri = "data:image/png;base64," + payload
    wrapped = "\n".join(payload[i:i + 76] for i in range(0, len(payload), 76))  # MIME line breaks
    forms = [
        {"image": str(path)}, {"image": uri}, {"image": "file://localhost" + uri[len("file://"):]},
        {"image": "FILE:" + uri[len("file:"):]},
        {"url": data_uri}, {"url": str(path)}, {"url": uri},
        {"path": str(path)}, {"path": path},
        {"base64": payload}, {"base64": wrapped}, {"base64": data_uri},
        {"image": str(path), "url": None, "text": None},  # keys set to None count as absent
    ]
    expected = np.asarray(load_image(str(path)))
    for keys in forms:
        chat_image = parsed_image(**keys)
        assert chat_image.size is None
        assert np.array_equal(np.asarray(load_image(chat_image.source)), expected), keys


@pytest.mark.parametrize("keys", [{"image": "https://example.com/cat.png"}, {"url": "http://example.com/cat.png"},
                                  {"url": "ftp://example.com/cat.png"}, {"path": "HTTPS://example.com/cat.png"}])
def test_network_urls_are_still_refused(keys):
    with pytest.raises(ImageLoadError, match="URLs are not fetched"):
        load_image(parsed_image(**keys).source)


def test_file_uri_errors_name_the_uri_and_the_path(tmp_path):
    missing = (tmp_path / "no such.png").as_uri()
    with pytest.raises(ImageLoadError, match=r"no%20such\.png'.*no such file \(.*/no such\.png\)"):
        load_image(missing)
    with pytest.raises(ImageLoadError, match="names a host \\('server'\\)"):
        load_image("file://server/share/a.png")
    with pytest.raises(ImageLoadError, match="base64 payload is not valid base64"):
        load_image(parsed_image(base64="@@not base64@@").source)


@pytest.mark.parametrize("keys", [{"image": "a.png", "url": "a.png"}, {"path": "a.png", "base64": "AAAA"},
                                  {"url": "a.png", "path": "b.png"}])
def test_two_image_sources_are_refused_naming_both(keys):
    first, second = keys
    with pytest.raises(InputError, match=f"part 0: an image part has '{first}' and '{second}'; give exactly one"):
        parse_conversation(image_part(**keys))


@pytest.mark.parametrize("part,fragment", [
    ({"type": "image", "image": "a.png", "max_pixel": 5}, "unknown key 'max_pixel' in an image part"),
    ({"type": "image", "image_url": "a.png"}, "unknown key 'image_url' in an image part"),
    ({"type": "text", "text": "x", "image": "a.png"}, "unknown key 'image' in a text part; accepted: 'type', 'text'"),
])
def test_unknown_keys_are_refused_naming_the_accepted_ones(part, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)) as info:
        parse_conversation([{"role": "user", "content": [part]}])
    if part["type"] == "image":
        for key in ("'image'", "'url'", "'path'", "'base64'", "'min_pixels'", "'max_pixels'", "'resized_height'",
                    "'resized_width'"):
            assert key in str(info.value)


@pytest.mark.parametrize("keys,fragment", [
    ({"url": 5}, "'url' must be a string"),
    ({"path": b"a.png"}, "'path' must be a string or a path"),
    ({"base64": b"AAAA"}, "'base64' must be a string"),
])
def test_source_keys_have_types(keys, fragment):
    with pytest.raises(InputError, match=fragment):
        parse_conversation(image_part(**keys))


def test_size_keys_travel_with_their_image():
    parsed = parse_conversation([{"role": "user", "content": [
        {"type": "image", "image": "a.png", "max_pixels": np.int64(50176)},
        {"type": "image", "image": "b.png"},
        {"type": "image", "image": "c.png", "resized_height": 300, "resized_width": 500},
        {"type": "image", "image": "d.png", "min_pixels": 3136, "max_pixels": 3136, "resized_height": None}]}])
    assert [image.size for image in parsed.images] == [
        ImageSize(max_pixels=50176), None, ImageSize(resized_height=300, resized_width=500),
        ImageSize(min_pixels=3136, max_pixels=3136)]
    assert type(parsed.images[0].size.max_pixels) is int


@pytest.mark.parametrize("keys,fragment", [
    ({"max_pixels": 0}, "max_pixels must be a positive whole number, got 0"),
    ({"min_pixels": -4}, "min_pixels must be a positive whole number, got -4"),
    ({"max_pixels": 1e6}, "max_pixels must be a positive whole number, got 1000000.0"),
    ({"max_pixels": "50176"}, "max_pixels must be a positive whole number, got '50176'"),
    ({"resized_width": True, "resized_height": 28}, "resized_width must be a positive whole number, got True"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels=5000 is above max_pixels=4000"),
    ({"resized_height": 300}, "resized_height needs resized_width too"),
    ({"resized_width": 300}, "resized_width needs resized_height too"),
    ({"resized_height": 300, "resized_width": 300, "max_pixels": 9000},
     "resized_height/resized_width fix the size: give them or min_pixels/max_pixels, not both"),
])
def test_bad_size_keys_name_the_key_and_the_problem(keys, fragment):
    with pytest.raises(InputError, match=r"message 0, part 0: " + re.escape(fragment)):
        parse_conversation(image_part(image="a.png", **keys))


# ---------------------------------------------------------------- size keys through a Pipeline

def image_tokens(pipe, image, **keys) -> int:
    return pipe.processor.load_image(parsed_image(image=image, **keys), "test").num_tokens


def prompt_tokens(pipe, image, **keys) -> int:
    (out,) = pipe.chat(image_part(image=image, **keys), SamplingParams(max_new_tokens=1), errors="raise")
    return out.num_prompt_tokens


def test_per_image_size_keys_change_the_image_tokens(pipe):
    """The tiny checkpoint's limits are 3136..200704 pixels: a 420x336 image is 15x12 merged
    tokens (180) as it is; max_pixels=28*28*16 shrinks it to 4x3 (12); resized 300x500 is
    308x504 (11x18 = 198 tokens, the helper's rounding); min_pixels=28*28*300 (above the
    checkpoint's limit, so with a max_pixels too) enlarges it to 560x448 (20x16 = 320)."""
    image = random_image(420, 336, seed=3)
    assert pipe.model.image_processor.min_pixels == 3136 and pipe.model.image_processor.max_pixels == 200704
    assert image_tokens(pipe, image) == 180
    assert image_tokens(pipe, image, max_pixels=28 * 28 * 16) == 12
    assert image_tokens(pipe, image, resized_height=300, resized_width=500) == 198
    assert image_tokens(pipe, image, min_pixels=28 * 28 * 300, max_pixels=28 * 28 * 400) == 320
    base = prompt_tokens(pipe, image)
    assert prompt_tokens(pipe, image, max_pixels=28 * 28 * 16) == base - 180 + 12
    assert prompt_tokens(pipe, image, resized_height=300, resized_width=500) == base - 180 + 198


def test_per_image_limits_above_the_pipeline_limits_are_one_clear_error(pipe):
    out = pipe.chat(image_part(image=random_image(64, 64, seed=1), min_pixels=2_000_000), errors="return")[0]
    assert out.finish_reason == "error"
    assert out.error == ("conversation 0, image 0: min_pixels=2000000 is above the pipeline's max_pixels=200704; "
                         "give max_pixels too")


def test_pipeline_wide_limits_and_per_image_overrides(checkpoint, pipe):
    """from_pretrained(min_pixels=, max_pixels=) sets every image's limits (transformers' rule);
    an image's own keys still win."""
    image = random_image(420, 336, seed=3)
    small = Pipeline.from_pretrained(checkpoint, device="cpu", max_pixels=28 * 28 * 16)
    try:
        assert (small.model.image_processor.min_pixels, small.model.image_processor.max_pixels) == (3136, 12544)
        assert image_tokens(small, image) == 12
        assert prompt_tokens(small, image) == prompt_tokens(pipe, image) - 180 + 12
        assert image_tokens(small, image, max_pixels=200704) == 180  # the image's own key wins
        assert image_tokens(small, image, resized_height=300, resized_width=500) == 198
    finally:
        small.close()


@pytest.mark.parametrize("limits,fragment", [
    ({"max_pixels": 0}, "max_pixels must be a positive whole number, got 0"),
    ({"min_pixels": 2.5}, "min_pixels must be a positive whole number, got 2.5"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels=5000 is above max_pixels=4000"),
    ({"max_pixels": 1000}, "max_pixels=1000 is below the checkpoint's min_pixels=3136; give min_pixels too"),
    ({"min_pixels": 2_000_000}, "min_pixels=2000000 is above the checkpoint's max_pixels=200704; give max_pixels"),
])
def test_bad_pipeline_limits_fail_before_the_weights_load(limits, fragment, checkpoint, monkeypatch):
    import mmpipe.pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(mmpipe.pipeline, "load_model", no_load)
    with pytest.raises(InputError, match="^Pipeline.from_pretrained: " + re.escape(fragment)):
        Pipeline.from_pretrained(checkpoint, device="cpu", **limits)
