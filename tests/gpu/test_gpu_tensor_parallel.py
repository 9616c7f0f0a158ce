"""Tensor parallelism on 2 GPUs (NCCL; skipped with fewer): in float32 the sharded Pipeline gives the
unsharded one's greedy tokens in every graph mode, with its decode and prefill graphs captured on
both ranks (the all-reduces and the logits' all-gather inside them); in bfloat16 the trained
bundled model captions the sample images as on one GPU. Run with `pytest -m gpu` on a machine of
two GPUs or more."""

from __future__ import annotations

import os

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from tests.unit.test_tensor_parallel_pipeline import conversations

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
MODES = ["none", "piecewise", "full_decode_only", "full_and_piecewise"]


def tokens(path: str, size: int, mode: str, dtype: str = "float32") -> tuple[list, dict]:
    pipe = Pipeline.from_pretrained(path, device="cuda:0", dtype=dtype, graph_mode=mode, tensor_parallel_size=size,
                                    num_kv_pages=512)
    try:
        out = [o.token_ids for o in pipe.chat(conversations(), GREEDY, progress=False)]
        return out, pipe.stats()
    finally:
        pipe.close()


@pytest.fixture(scope="module")
def reference(checkpoint):
    return tokens(checkpoint, 1, "none")[0]


@pytest.mark.parametrize("mode", MODES)
def test_two_gpus_give_one_gpus_tokens_in_every_graph_mode(checkpoint, reference, mode):
    ours, stats = tokens(checkpoint, 2, mode)
    assert ours == reference
    assert stats["tensor_parallel"]["size"] == 2
    assert all(stats[name]["capture_failures"] == 0 for name in ("decode", "prefill"))
    if mode in ("full_decode_only", "full_and_piecewise"):
        assert stats["decode"]["graphs"] > 0 and stats["decode"]["graph_runs"] > 0
    if mode in ("piecewise", "full_and_piecewise"):
        assert stats["prefill"]["graphs"] > 0 and stats["prefill"]["graph_runs"] > 0


def test_the_bundled_model_captions_the_same_in_bfloat16_on_two_gpus():
    from mmpipe.pipeline import default_model_path

    images = sorted(os.path.join("assets/images", f) for f in os.listdir("assets/images") if f.endswith(".png"))
    captions = []
    for size in (1, 2):
        pipe = Pipeline.from_pretrained(default_model_path(), device="cuda:0", dtype="bfloat16",
                                        tensor_parallel_size=size)
        try:
            captions.append(pipe.caption(images, progress=False))
        finally:
            pipe.close()
    assert captions[0] == captions[1] and all(captions[0])
