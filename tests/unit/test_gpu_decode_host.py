"""The host side of the all-GPU image path (`image_decode="gpu"`), on the CPU: which files the GPU
decodes (only the header read here, the grid the Pillow path would give) and which stay on
Pillow; the setting refused clearly where it cannot work; and an image that fails when its pack
is encoded failing its request alone with the Pillow path's message. The device side is
`tests/gpu/test_gpu_decode.py`."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from mmpipe.vision.gpu_decode import deferred_jpeg
from mmpipe.vision.preprocess import ImageProcessorConfig, preprocess_image
from PIL import Image

from mmpipe import EngineConfig, InputError, Pipeline, SamplingParams
from mmpipe.errors import ImageLoadError
from mmpipe.inputs import decode_encoded
from tests.helpers import random_image

CFG = ImageProcessorConfig()


def jpeg(image: Image.Image, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92, **save)
    return buffer.getvalue()


@pytest.mark.parametrize("size", [(448, 448), (1000, 333), (57, 90), (3000, 2000), (29, 29)])
def test_a_colour_jpeg_is_deferred_with_the_grid_pillow_would_give(size):
    data = jpeg(random_image(*size, seed=sum(size)))
    deferred = deferred_jpeg(data, "x.jpg", CFG)
    on_host = preprocess_image(decode_encoded(data, "x.jpg"), CFG)
    assert deferred is not None and deferred.pixels is None and deferred.jpeg == data
    assert deferred.grid_thw == on_host.grid_thw and deferred.num_tokens == on_host.num_tokens
    assert deferred.key != on_host.key  # other pixels (nvJPEG, torchvision's resize): another cache entry


def test_the_key_follows_the_bytes_and_the_preprocessing():
    data = jpeg(random_image(300, 200, seed=1))
    key = deferred_jpeg(data, "a", CFG).key
    assert deferred_jpeg(data, "b", CFG).key == key  # the same file under another name
    assert deferred_jpeg(jpeg(random_image(300, 200, seed=2)), "a", CFG).key != key
    assert deferred_jpeg(data, "a", CFG.with_limits(max_pixels=128 * 128)).key != key
    assert deferred_jpeg(data, "a", replace(CFG, image_mean=(0.5, 0.5, 0.5))).key != key  # same size, other values


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90
    return jpeg(random_image(120, 80, seed=3), exif=exif.tobytes())


def _adobe_rgb() -> bytes:
    """A colour JPEG with an Adobe APP14 segment saying its channels are stored as RGB (transform
    0), not YCbCr: Pillow reads it as RGB, nvJPEG would convert it as YCbCr."""
    data = jpeg(random_image(90, 60, seed=9))
    app14 = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00"
    return data[:2] + app14 + data[2:]


def _png() -> bytes:
    buffer = io.BytesIO()
    random_image(64, 64, seed=4).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("data", [
    pytest.param(lambda: jpeg(random_image(90, 60, seed=5, mode="L")), id="grayscale"),
    pytest.param(lambda: jpeg(random_image(90, 60, seed=6).convert("CMYK")), id="cmyk"),
    pytest.param(_exif_rotated, id="exif-rotation"),
    pytest.param(_png, id="png"),
    pytest.param(lambda: jpeg(random_image(90, 60, seed=7))[:-400], id="truncated"),
    pytest.param(lambda: b"\xff\xd8\xff" + b"\x00" * 64, id="zeros"),
    pytest.param(lambda: b"\xff\xd8\xff\xe0" + b"junk" * 16 + b"\xff\xd9", id="unreadable-header"),
    pytest.param(_adobe_rgb, id="adobe-rgb"),
])
def test_what_nvjpeg_cannot_take_as_pillow_would_stays_on_pillow(data):
    assert deferred_jpeg(data(), "x", CFG) is None


def test_a_resample_filter_torchvision_lacks_stays_on_pillow():
    data = jpeg(random_image(90, 60, seed=8))
    assert deferred_jpeg(data, "x", CFG) is not None
    assert deferred_jpeg(data, "x", ImageProcessorConfig(resample=Image.Resampling.LANCZOS)) is None


def test_the_setting_is_checked_and_refused_off_cuda():
    with pytest.raises(InputError, match="image_decode='nvjpeg': use one of cpu, gpu"):
        EngineConfig(image_decode="nvjpeg")
    with pytest.raises(InputError, match="image_decode='gpu' needs a CUDA device; this pipeline runs on cpu"):
        Pipeline.from_pretrained(device="cpu", image_decode="gpu")


def _chat(image) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]


def test_an_image_that_fails_when_its_pack_is_encoded_fails_its_request_alone():
    """What the GPU path does with a file neither nvJPEG nor Pillow can decode (the Pillow error,
    raised while the pack is encoded), injected into the encoder on the CPU."""
    images = [random_image(64, 64, seed=1), random_image(80, 64, seed=2), random_image(72, 64, seed=3)]
    with Pipeline.from_pretrained(device="cpu") as pipe:
        want = [o.token_ids for o in pipe.chat([_chat(images[0]), _chat(images[2])], SamplingParams(max_new_tokens=6))]
        bad_key = pipe.processor.load_image(images[1], "x").key
        run_vision = pipe.runner.run_vision

        def encoder(pack):
            if any(im.key == bad_key for im in pack):
                raise ImageLoadError("image 'broken.jpg': cannot decode (broken data stream)")
            return run_vision(pack)

        pipe.runner.run_vision = encoder
        pipe.engine.cache.clear()
        outs = pipe.chat([_chat(im) for im in images], SamplingParams(max_new_tokens=6))
        assert [o.ok for o in outs] == [True, False, True]
        # As the Pillow path words it in the worker threads: the request, the image, the file.
        assert outs[1].error == "conversation 1, image 0: image 'broken.jpg': cannot decode (broken data stream)"
        assert [outs[0].token_ids, outs[2].token_ids] == want
        stats = pipe.stats()
        assert stats["requests"]["running"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]


def test_decoding_is_split_by_decoded_bytes(monkeypatch):
    """Many large photos shrunk to few patches are decoded a bounded number of bytes at a time."""
    from mmpipe.vision import gpu_decode

    monkeypatch.setattr(gpu_decode, "DECODE_BYTES", 3 * 1000 * 1000)
    big = [deferred_jpeg(jpeg(random_image(1000 - k, 500, seed=k)), "x", CFG) for k in range(5)]
    parts = gpu_decode._parts(big)
    assert [len(p) for p in parts] == [2, 2, 1] and sum(parts, []) == big  # 1.5 MB each, in order
    assert gpu_decode._parts([]) == []
    alone = gpu_decode._parts([deferred_jpeg(jpeg(random_image(2000, 1000, seed=9)), "x", CFG)])
    assert [len(p) for p in alone] == [1]  # a file larger than the budget still gets a part


def test_out_of_memory_while_decoding_is_out_of_memory_not_a_reason_for_pillow():
    """torchvision re-raises an allocation failure as a plain RuntimeError: the engine must see
    it as out of memory (retry alone, then a clear error), not silently decode with Pillow."""
    import torch
    from mmpipe.vision.gpu_decode import _raise_if_out_of_memory

    with pytest.raises(torch.OutOfMemoryError):
        _raise_if_out_of_memory(RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to ..."))
    _raise_if_out_of_memory(RuntimeError("Error while decoding JPEG images: Failed to decode batch: 7"))
