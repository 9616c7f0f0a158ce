"""A real out-of-memory on the GPU (`pytest -m gpu`): with the device filled so that what is left
covers a small image's ViT call but not a big one's, the big image fails its request alone with a
clear error; the other requests of the step give what they give with the memory free, the graphs
keep replaying, and once the filler is gone the KV pool, the graph memory and the allocator are
back at their baseline and the big image is served. The injected-failure counterpart on the CPU
is `tests/unit/test_out_of_memory.py`."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmpipe import DeviceMemoryError, Pipeline, SamplingParams
from tests.helpers import random_image

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_new_tokens=8)
SCENES = Path(__file__).parents[2] / "assets" / "images"  # the bundled model answers these confidently
BIG_SIDE = 1232  # 88 x 88 patches, 1,936 image tokens: as large as the bundled model's 2,048 positions allow
MAX_VISION_PATCHES = 4096  # the big image is above every ViT graph: it runs eagerly, with fresh allocations


def _chat(image, **limits) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": image, **limits},
                                         {"type": "text", "text": "What is in the picture?"}]}]


def _graph_memory(pipe) -> dict[str, int]:
    stats = pipe.stats()
    return {name: stats[name]["memory_bytes"] for name in ("vit", "decode", "prefill")}


def _replays(pipe) -> int:
    stats = pipe.stats()
    return sum(stats[name]["replays"] for name in ("vit", "decode", "prefill"))


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _peak_bytes(pipe, image) -> int:
    """Device memory one image's encoding takes beyond what is allocated, with cuBLAS workspaces
    made afresh (each capture clears them, so a call after one pays for a new workspace)."""
    _settle()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    pipe.runner.encode_images([pipe.processor.load_image(image, "probe")])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_an_image_that_does_not_fit_fails_alone_and_everything_returns_to_baseline():
    small_a, small_b = (Image.open(SCENES / f"scene_{i}.png").convert("RGB") for i in (0, 1))
    big_image = random_image(BIG_SIDE, BIG_SIDE, seed=3)
    big = _chat(big_image)
    with Pipeline.from_pretrained(device="cuda", max_pixels=BIG_SIDE * BIG_SIDE,
                                  max_vision_patches=MAX_VISION_PATCHES) as pipe:
        want = [o.token_ids for o in pipe.chat([_chat(small_a), _chat(small_b)], GREEDY)]
        for image in (small_a, small_b):  # the ViT graph of each image alone, as the retry encodes them
            pipe.engine.cache.clear()
            pipe.chat(_chat(image), GREEDY)
        small_need = max(_peak_bytes(pipe, image) for image in (small_a, small_b))
        big_need = _peak_bytes(pipe, big_image)  # eager (no graph is that large): nothing captured by measuring
        assert big_need > 3 * small_need, (small_need, big_need)
        headroom = (small_need + big_need) // 2 + (8 << 20)
        graph_memory, replays, eager = _graph_memory(pipe), _replays(pipe), pipe.stats()["vit"]["eager_runs"]
        _settle()
        reserved = torch.cuda.memory_reserved()

        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(free - headroom, dtype=torch.uint8, device="cuda")
        try:
            pipe.engine.cache.clear()  # the small images are encoded again, beside the big one
            outs = pipe.chat([_chat(small_a), big, _chat(small_b)], GREEDY)
        finally:
            del filler
        assert [o.ok for o in outs] == [True, False, True], [o.error for o in outs]
        assert "out of GPU memory encoding it, even alone" in outs[1].error and "max_pixels" in outs[1].error
        assert [outs[0].token_ids, outs[2].token_ids] == want
        assert _replays(pipe) > replays  # the graphs served the other requests
        assert pipe.stats()["vit"]["eager_runs"] > eager  # the big image really was tried, without a graph

        stats = pipe.stats()
        assert stats["requests"]["running"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]
        assert _graph_memory(pipe) == graph_memory  # nothing captured or lost on the way
        _settle()
        assert abs(torch.cuda.memory_reserved() - reserved) <= 32 << 20

        # With the memory back, the engine serves the big image too, and the others as before.
        again = pipe.chat([_chat(small_a), big], GREEDY)
        assert [o.ok for o in again] == [True, True] and again[0].token_ids == want[0]


def test_a_pipeline_on_a_nearly_full_gpu_says_what_it_needed_and_what_was_free():
    _settle()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(DeviceMemoryError, match=r"not enough GPU memory: 0\.\d\d GiB free of .* GiB for activations"):
            Pipeline.from_pretrained(device="cuda")
    finally:
        del filler
    _settle()
    with Pipeline.from_pretrained(device="cuda") as pipe:  # nothing left behind by the failed start
        assert pipe.chat(_chat(Image.open(SCENES / "scene_2.png").convert("RGB")), GREEDY)[0].ok
