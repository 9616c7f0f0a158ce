"""Qwen2-VL, Qwen3-VL and Qwen3-VL-MoE on CUDA (`pytest -m gpu`): float32 parity with transformers, bfloat16
logits within tolerance, ViT graphs equal to eager for both towers (deepstack levels included,
equal totals with different boundaries), identical greedy tokens in every LM graph mode, and the
deepstack buffers read by piecewise graphs captured on text-only forwards."""

from __future__ import annotations

import pytest
import torch
from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
from mmpipe.vision.qwen2_vl import FullAttentionVisionConfig, Qwen2VisionTransformer
from mmpipe.vision.qwen3_vl import Qwen3VisionTransformer

from mmpipe import Pipeline, SamplingParams
from mmpipe.config import GraphConfig
from tests.helpers import (
    first_logits,
    hf_inputs,
    hf_model,
    make_checkpoint,
    random_pack,
    rel_err,
    tower_on_cuda,
)
from tests.parity_cases import CASES, GREEDY_32, assert_matches, one_image, two_images

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FAMILIES = ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe"]
TOWERS = ["qwen2_vl", "qwen3_vl"]  # (Qwen3-VL-MoE has Qwen3-VL's tower)


@pytest.fixture(autouse=True)
def exact_float32():
    """The float32 oracle in float32: cuDNN may otherwise run transformers' Conv3d patch embedding
    in TF32 (its default), a 1e-3 error that the comparison would charge to mmpipe."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {f: make_checkpoint(str(tmp_path_factory.mktemp(f)), family=f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_on_cuda_matches_transformers(paths, family):
    path = paths[family]
    pipe = Pipeline.from_pretrained(path, device="cuda", dtype="float32", num_kv_pages=2048)
    reference = hf_model(path, device="cuda", dtype=torch.float32)
    for case in CASES.values():
        assert_matches(pipe, reference, path, case(), device="cuda", logprob_tol=1e-3)
    pipe.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_logits_within_tolerance(paths, family):
    path = paths[family]
    pipe = Pipeline.from_pretrained(path, device="cuda", dtype="bfloat16", num_kv_pages=2048)
    reference = hf_model(path, device="cuda", dtype=torch.bfloat16)
    for case in CASES.values():
        conversation = case()
        with torch.no_grad():
            ref = reference(**hf_inputs(path, conversation, device="cuda")).logits[0, -1].float()
        assert rel_err(first_logits(pipe, conversation), ref) <= 2e-2
    pipe.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_modes_give_identical_greedy_tokens(paths, family):
    conversations = [case() for case in CASES.values()]
    results = {}
    for mode in ("none", "full_decode_only", "piecewise", "full_and_piecewise"):
        pipe = Pipeline.from_pretrained(paths[family], device="cuda", dtype="float32", num_kv_pages=2048,
                                        graph_mode=mode, decode_graph=GraphConfig(buckets=(1, 2, 4, 8)),
                                        prefill_graph=GraphConfig(buckets=(16, 64, 128, 256, 512)))
        results[mode] = [o.token_ids for o in pipe.chat(conversations, GREEDY_32)]
        stats = pipe.stats()
        assert (stats["decode"]["graphs"] > 0) == (mode in ("full_decode_only", "full_and_piecewise"))
        assert (stats["prefill"]["graphs"] > 0) == (mode in ("piecewise", "full_and_piecewise"))
        pipe.close()
    assert all(tokens == results["none"] for tokens in results.values())


def test_deepstack_after_text_only_capture_on_real_graphs(paths):
    """Piecewise graphs captured at start-up (text-only dummy forwards), a text step replayed first,
    then image steps at sizes already replayed: equal to the eager prefill, all on graphs."""
    path = paths["qwen3_vl"]
    kw = dict(device="cuda", dtype="float32", num_kv_pages=1024, max_running_requests=4, max_prefill_tokens=256)
    graphs = Pipeline.from_pretrained(path, graph_mode="piecewise", prefill_graph=GraphConfig(buckets=(64, 256)), **kw)
    eager = Pipeline.from_pretrained(path, graph_mode="none", **kw)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0, logprobs=5)
    for conversation in [CASES["text"](), one_image(), [{"role": "user", "content": "count " * 30}], two_images()]:
        ours, ref = graphs.chat(conversation, params)[0], eager.chat(conversation, params)[0]
        assert ours.token_ids == ref.token_ids
        assert max(abs(a[t] - b[t]) for a, b in zip(ours.logprobs, ref.logprobs) for t in b) <= 1e-4
    stats = graphs.stats()["prefill"]
    assert stats["graph_runs"] >= 4 and stats["detail"]["compiled_runs"] == 0
    graphs.close()
    eager.close()


# ---------------------------------------------------------------------------- ViT graphs

def make_tower(family: str, seed: int = 0):
    cfg = FullAttentionVisionConfig(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=192,
                                    patch_size=16 if family == "qwen3_vl" else 14,
                                    hidden_act="gelu_pytorch_tanh" if family == "qwen3_vl" else "quick_gelu",
                                    num_position_embeddings=256 if family == "qwen3_vl" else 0,
                                    deepstack_visual_indexes=(1, 2) if family == "qwen3_vl" else ())
    return tower_on_cuda((Qwen3VisionTransformer if family == "qwen3_vl" else Qwen2VisionTransformer)(cfg), seed)


pack = random_pack


@pytest.mark.parametrize("family", TOWERS)
def test_vit_graphs_equal_eager(family):
    vit = make_tower(family)
    runner = ViTGraphRunner(vit, CUDA, default_buckets(4096))
    with torch.inference_mode():
        for i, grids in enumerate([[(1, 4, 4)], [(1, 8, 12)], [(1, 32, 32)], [(1, 46, 30)], [(1, 2, 60)],
                                   [(1, 8, 8), (1, 6, 10), (1, 12, 4)]]):
            pixels, meta = pack(vit, grids, seed=i)
            graph, graphed = runner.forward(pixels, meta)
            assert graphed
            eager = vit(pixels, meta)
            assert graph.shape == eager.shape == ((meta.num_merged, 3, 192) if family == "qwen3_vl"
                                                  else (meta.num_merged, 192))
            assert rel_err(graph, eager) <= 1e-2, grids
    assert runner.stats()["eager_runs"] == 0
    runner.close()


@pytest.mark.parametrize("family", TOWERS)
def test_vit_same_total_different_boundaries(family):
    """4+6+8 vs 5+5+8 merged rows in one bucket's graph, alternately: boundaries are inputs."""
    vit = make_tower(family, seed=1)
    runner = ViTGraphRunner(vit, CUDA, [72, 128])
    packs = [pack(vit, g, seed=s) for s, g in enumerate([[(1, 4, 4), (1, 4, 6), (1, 4, 8)],
                                                         [(1, 2, 10), (1, 2, 10), (1, 4, 8)]])]
    with torch.inference_mode():
        eager = [vit(p, m) for p, m in packs]
        for _ in range(3):
            for (pixels, meta), expected in zip(packs, eager):
                assert rel_err(runner.forward(pixels, meta)[0].clone(), expected) <= 1e-2
        frozen = runner.forward(*packs[0])[0].clone()
    assert runner.stats()["captures"] == 1 and rel_err(frozen, eager[1]) > 0.1
    runner.close()
