"""The bundled model really captions: accuracy on fresh scenes, agreement with transformers, and
the same tokens on CUDA as on the CPU."""

from __future__ import annotations

import os

import pytest
from mmpipe.app.tiny.eval import TEST_SEED_BASE, mmpipe_captions, transformers_captions
from mmpipe.app.tiny.scenes import make_scene, score

from mmpipe import Pipeline
from mmpipe.pipeline import default_model_path

SCENES = [make_scene(s) for s in range(TEST_SEED_BASE, TEST_SEED_BASE + 40)]


@pytest.fixture(scope="module")
def bundled():
    return Pipeline.from_pretrained(device="cpu")


@pytest.fixture(scope="module")
def cpu_tokens(bundled):
    return mmpipe_captions(bundled, [s.image for s in SCENES])


def test_default_model_loads_without_a_path(bundled):
    assert os.path.samefile(bundled.model.path, default_model_path())
    assert bundled.model.spec.architecture == "Qwen2_5_VLForConditionalGeneration"


def test_captions_fresh_scenes_accurately(bundled, cpu_tokens):
    captions = [bundled.tokenizer.decode(t, skip_special_tokens=True).strip() for t in cpu_tokens]
    result = score(captions, [s.caption for s in SCENES])
    assert result["exact"] >= 0.90, result
    assert result["colour_shape_scenes"] >= 0.97, result


def test_transformers_gives_the_same_greedy_tokens(bundled, cpu_tokens):
    reference = transformers_captions(bundled.model.path, [s.image for s in SCENES[:12]], "cpu")
    assert cpu_tokens[:12] == reference


def test_sample_images_caption(bundled):
    folder = os.path.join(os.path.dirname(default_model_path()), "images")
    paths = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".png"))
    expected = dict(line.rstrip("\n").split("\t") for line in open(os.path.join(folder, "captions.tsv")))
    assert len(paths) >= 4
    captions = bundled.caption(paths)
    correct = sum(expected[os.path.basename(p)] == c for p, c in zip(paths, captions))
    assert correct >= len(paths) - 1


@pytest.mark.gpu
def test_cuda_float32_tokens_equal_cpu(cpu_tokens):
    cuda = Pipeline.from_pretrained(device="cuda", dtype="float32", num_kv_pages=4096)
    assert mmpipe_captions(cuda, [s.image for s in SCENES]) == cpu_tokens
