"""Tensor parallelism on 2 GPUs (NCCL; skipped with fewer): in float32 the sharded Pipeline gives the
unsharded one's greedy tokens in every graph mode, with its decode and prefill graphs captured on
both ranks (the all-reduces and the logits' all-gather inside them); in bfloat16 the trained
bundled model captions the sample images as on one GPU; on 4 GPUs, two KV heads replicated over four
ranks give one GPU's tokens. Run with `pytest -m gpu` on a machine of two GPUs or more."""

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


def tokens(path: str, size: int, mode: str, dtype: str = "float32", **settings) -> tuple[list, dict]:
    pipe = Pipeline.from_pretrained(path, device="cuda:0", dtype=dtype, graph_mode=mode, tensor_parallel_size=size,
                                    num_kv_pages=512, **settings)
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


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_four_gpus_sharing_two_kv_heads_give_one_gpus_tokens(checkpoint_factory, mode):
    """8 query heads, 2 KV heads at TP=4: each KV head replicated on two ranks, eagerly and with
    every graph runner."""
    path = checkpoint_factory(text={"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2})
    ours, stats = tokens(path, 4, mode)
    assert ours == tokens(path, 1, "none")[0]
    assert stats["tensor_parallel"]["size"] == 4
    if mode == "full_and_piecewise":
        assert stats["decode"]["graph_runs"] > 0 and stats["prefill"]["graph_runs"] > 0


@pytest.mark.parametrize("vit_parallel", ["tensor", "rank0"])
def test_the_other_vision_modes_give_one_gpus_tokens_with_graphs(checkpoint, reference, vit_parallel):
    """The tower split over both GPUs (its ViT graphs captured in lockstep, all-reduces inside),
    or run whole on rank 0: the same tokens as one GPU."""
    ours, stats = tokens(checkpoint, 2, "full_and_piecewise", vit_parallel=vit_parallel)
    assert ours == reference
    assert stats["tensor_parallel"]["vision_sharded"] == (vit_parallel == "tensor")
    vit, parallel = stats["vit"], stats["tensor_parallel"]
    print(vit_parallel, {k: vit[k] for k in ("enabled", "graph_runs", "eager_runs")}, parallel["worker_vit_runs"])
    assert parallel["images_encoded_by_workers"] == 0
    if vit_parallel == "tensor":  # the worker ran every pack as rank 0 did, by the same graphs
        assert parallel["worker_vit_runs"][1] == {"graph_runs": vit["graph_runs"], "eager_runs": vit["eager_runs"]}
    if vit["enabled"]:
        assert vit["graph_runs"] > 0


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    """A checkpoint whose MLP and query parts fall on 128-wide scale blocks at TP=2, in both
    published FP8 formats with the same weights dequantized by hand; and the plain checkpoint
    (twice: quantized at load, and unquantized as the reference)."""
    from tests.helpers import make_checkpoint
    from tests.unit.test_fp8_checkpoints import fp8_pair

    tmp = tmp_path_factory.mktemp("fp8_tp")
    base = make_checkpoint(str(tmp / "base"), text={
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}})
    pairs = {fmt: fp8_pair(base, tmp, fmt, block=(128, 128)) for fmt in ("channel", "block")}
    return {**pairs, "at-load": (base, base)}  # quantization="fp8": each rank quantizes its shard


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores")
@pytest.mark.parametrize("fmt", ["channel", "block", "at-load"])
def test_an_fp8_checkpoint_splits_over_two_gpus_in_fp8(fp8_checkpoints, fmt):
    """Each rank keeps its part of every FP8 layer in FP8 (scales cut with the weights), or
    quantizes its shard at load (`quantization="fp8"`): graphs
    give eager's tokens, and the first-token logits stay as close to the weights dequantized by
    hand (the unquantized weights) as one GPU's are (each rank quantizes its own part of a row-parallel input, so TP=2 is
    not bit-equal to TP=1)."""
    from tests.helpers import first_logits, rel_err

    quantized, by_hand = fp8_checkpoints[fmt]
    settings = {"quantization": "fp8"} if fmt == "at-load" else {}
    convs = conversations()
    logits, runs = {}, {}
    for size, mode in ((1, "none"), (2, "none"), (2, "full_and_piecewise")):
        pipe = Pipeline.from_pretrained(quantized, device="cuda:0", dtype="float32", graph_mode=mode,
                                        tensor_parallel_size=size, num_kv_pages=512, **settings)
        try:
            assert ("quantized at load" if settings else "kept in FP8") in pipe.model.quantization, \
                pipe.model.quantization
            runs[(size, mode)] = [o.token_ids for o in pipe.chat(convs, GREEDY, progress=False)]
            if mode == "none":
                logits[size] = first_logits(pipe, convs[0])
        finally:
            pipe.close()
    assert runs[(2, "none")] == runs[(2, "full_and_piecewise")]
    exact = Pipeline.from_pretrained(by_hand, device="cuda:0", dtype="float32", graph_mode="none", num_kv_pages=512)
    try:
        reference = first_logits(exact, convs[0])
    finally:
        exact.close()
    one, two = rel_err(logits[1], reference), rel_err(logits[2], reference)
    print(f"{fmt}: first-token logits vs by hand: TP=1 {one:.4f}, TP=2 {two:.4f}; TP=2 vs TP=1 "
          f"{rel_err(logits[2], logits[1]):.4f}")
    assert 1e-5 < two < 0.1 and two < 2 * one + 1e-3
    assert rel_err(logits[2], logits[1]) < 0.1


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
