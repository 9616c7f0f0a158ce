"""The same encoded image file given again is not decoded and resized again: a chat's later
turns, a repeated image. Keyed by the file's content and the preprocessing config; bounded."""

from __future__ import annotations

import numpy as np
import pytest
from mmpipe.vision.preprocess import ImageSize
from PIL import Image

import mmpipe.engine.processor as processor_module
from mmpipe import Pipeline, SamplingParams
from mmpipe.engine.preprocessed_cache import PreprocessedCache
from mmpipe.errors import InputError
from mmpipe.inputs import ChatImage

ONE = SamplingParams(max_new_tokens=3)


def _png(path, seed: int, size: int = 96) -> str:
    rng = np.random.default_rng(seed)
    pixels = (rng.integers(0, 200, (size, size, 3)) + np.arange(size)[None, :, None]).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.fixture()
def counted_decodes(monkeypatch):
    calls = []
    original = processor_module.decode_encoded

    def counting(data, source):
        calls.append(source)
        return original(data, source)

    monkeypatch.setattr(processor_module, "decode_encoded", counting)
    return calls


def _chat(path: str) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "What?"}]}]


def test_a_file_given_again_is_not_decoded_again_and_answers_the_same(tmp_path, counted_decodes):
    path = _png(tmp_path / "a.png", 1)
    with Pipeline.from_pretrained(device="cpu") as pipe:
        first = pipe.chat([_chat(path)], ONE)[0]
        again = pipe.chat([_chat(path)], ONE)[0]
        assert len(counted_decodes) == 1
        assert again.token_ids == first.token_ids
        assert pipe.stats()["preprocessed_cache"]["hits"] == 1
        # Rewritten in place with other pixels: a new entry (content-addressed), decoded again.
        _png(path, 2)
        changed = pipe.processor.load_image(path, "test")
        assert len(counted_decodes) == 2
        # Another file with the first file's bytes: the same entry (the key is the content).
        copy = pipe.processor.load_image(_png(tmp_path / "b.png", 1), "test")
        assert len(counted_decodes) == 2 and copy.key != changed.key
        # An image part's own size keys are another preprocessing: another entry.
        small = pipe.processor.load_image(ChatImage(path, ImageSize(resized_height=56, resized_width=56)), "test")
        assert len(counted_decodes) == 3 and small.grid_thw != changed.grid_thw


def test_turned_off_with_zero_bytes(tmp_path, counted_decodes):
    path = _png(tmp_path / "a.png", 1)
    with Pipeline.from_pretrained(device="cpu", preprocessed_cache_bytes=0) as pipe:
        pipe.processor.load_image(path, "x")
        pipe.processor.load_image(path, "x")
        assert pipe.stats()["preprocessed_cache"]["misses"] == 0  # not even looked up (no hashing)
    assert len(counted_decodes) == 2


def test_bad_files_are_never_cached(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with Pipeline.from_pretrained(device="cpu") as pipe:
        for _ in range(2):
            with pytest.raises(InputError, match="bad.png"):
                pipe.processor.load_image(str(bad), "conversation 0, image 0")
        assert pipe.stats()["preprocessed_cache"]["entries"] == 0


def test_least_recently_used_entries_leave_first_within_the_byte_bound():
    class Image_:  # stands for a PreprocessedImage: only its pixels' size matters here
        def __init__(self, n: int) -> None:
            self.pixels = np.zeros(n, dtype=np.uint8)

    cache = PreprocessedCache(capacity_bytes=250)
    keys = [cache.key(bytes([i]) * 10, "cfg") for i in range(3)]
    for key in keys:
        cache.put(key, Image_(100))
    assert cache.get(keys[0]) is None and cache.get(keys[1]) is not None and cache.used == 200
    cache.put(cache.key(b"x", "cfg"), Image_(100))  # evicts keys[2], the least recently used
    assert cache.get(keys[2]) is None and cache.get(keys[1]) is not None
    cache.put(cache.key(b"big", "cfg"), Image_(300))  # larger than the bound: not kept
    assert cache.used <= 250
    assert cache.key(b"same", "a") != cache.key(b"same", "b")
