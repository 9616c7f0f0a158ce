"""Qwen3-VL-MoE on 2 GPUs (NCCL; skipped with fewer): every expert split along its width (tensor
parallel) or the experts split whole (expert parallel) give one GPU's greedy tokens in float32,
with logprobs within all-reduce rounding, in every graph mode, for image, video and text
prompts; FP8 experts (a block-scaled checkpoint, and `quantization="fp8"` at load) split both
ways stay in FP8 and their graphs give eager's tokens. Run with `pytest -m gpu` on a machine of
two GPUs or more."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from tests.unit.test_tensor_parallel_pipeline import conversations

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
MODES = ["none", "piecewise", "full_decode_only", "full_and_piecewise"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Tiny Qwen3-VL-MoE (8 experts, 2 per token, routers drawn with a spread) and prompts with
    images, a video and text alone."""
    from tests.helpers import make_checkpoint
    from tests.video_helpers import make_video

    folder = tmp_path_factory.mktemp("moe_tp")
    path = make_checkpoint(str(folder / "ckpt"), family="qwen3_vl_moe", text={"moe_intermediate_size": 128})
    clip = make_video(folder / "clip.mp4", 30, 96, 72, fps=15)
    convs = conversations() + [[{"role": "user", "content": [{"type": "video", "video": clip},
                                                             {"type": "text", "text": "What happens?"}]}]]
    return path, convs


def run(path: str, convs: list, size: int, mode: str, **settings) -> tuple[list, list, dict]:
    pipe = Pipeline.from_pretrained(path, device="cuda:0", dtype="float32", graph_mode=mode,
                                    tensor_parallel_size=size, num_kv_pages=1024, **settings)
    try:
        outs = pipe.chat(convs, GREEDY, progress=False)
        chosen = [[step[t] for step, t in zip(o.logprobs, o.token_ids)] for o in outs]
        return [o.token_ids for o in outs], chosen, pipe.stats()
    finally:
        pipe.close()


@pytest.fixture(scope="module")
def one_gpu(moe):
    path, convs = moe
    return run(path, convs, 1, "none")


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor", "expert"])
@pytest.mark.parametrize("mode", MODES)
def test_two_gpus_split_the_experts_and_give_one_gpus_tokens(moe, one_gpu, mode, expert_parallel):
    path, convs = moe
    tokens, logprobs, stats = run(path, convs, 2, mode, expert_parallel=expert_parallel)
    assert tokens == one_gpu[0]
    worst = max(abs(a - b) for ours, theirs in zip(logprobs, one_gpu[1]) for a, b in zip(ours, theirs))
    assert worst < 1e-4, worst
    assert stats["tensor_parallel"]["size"] == 2
    assert all(stats[name]["capture_failures"] == 0 for name in ("decode", "prefill"))
    if mode in ("full_decode_only", "full_and_piecewise"):
        assert stats["decode"]["graph_runs"] > 0
    if mode in ("piecewise", "full_and_piecewise"):
        assert stats["prefill"]["graph_runs"] > 0


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """Experts 256 wide (two 128-wide scale blocks: one per rank under tensor parallelism), in
    the FP8 releases' per-expert layout; and the original, quantized at load (`quantization="fp8"`)."""
    from tests.helpers import make_checkpoint
    from tests.moe_checkpoints import fp8_per_expert

    folder = tmp_path_factory.mktemp("moe_fp8_tp")
    base = make_checkpoint(str(folder / "base"), family="qwen3_vl_moe",
                           text={"hidden_size": 128, "moe_intermediate_size": 256})
    stored, _ = fp8_per_expert(base, folder, dense=False)
    return {"stored": (stored, {}), "at-load": (base, {"quantization": "fp8"})}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor", "expert"])
@pytest.mark.parametrize("fmt", ["stored", "at-load"])
def test_fp8_experts_split_over_two_gpus_stay_fp8_and_graphs_match_eager(fp8_moe, fmt, expert_parallel):
    """Each rank keeps its part of the experts in FP8; its graphs give its eager tokens. Stored FP8
    experts (every other layer unquantized): a rank's activations fall on the same 128-column
    blocks as one GPU's, so its first-token logits equal one GPU's up to summation order. At load
    every linear layer is quantized too, and a row-parallel layer's activations are quantized per
    rank: TP=2 stays as close to the unquantized model as one GPU does."""
    from mmpipe.layers.fp8_experts import Fp8Experts
    from tests.helpers import first_logits, rel_err

    path, settings = fp8_moe[fmt]
    convs = conversations()
    tokens, logits = {}, {}
    for size, mode, quantize in ((1, "none", True), (2, "none", True), (2, "full_and_piecewise", True),
                                 (1, "none", False)):
        if not quantize and fmt == "stored":
            break
        pipe = Pipeline.from_pretrained(path, device="cuda:0", dtype="float32", graph_mode=mode,
                                        tensor_parallel_size=size, expert_parallel=expert_parallel and size > 1,
                                        num_kv_pages=512, **(settings if quantize else {}))
        try:
            assert sum(isinstance(m, Fp8Experts) for m in pipe.model.language.modules()) == (2 if quantize else 0)
            tokens[(size, mode)] = [o.token_ids for o in pipe.chat(convs, GREEDY, progress=False)]
            if mode == "none":
                logits[(size, quantize)] = first_logits(pipe, convs[0])
        finally:
            pipe.close()
    assert tokens[(2, "none")] == tokens[(2, "full_and_piecewise")]
    split = rel_err(logits[(2, True)], logits[(1, True)])
    print(f"{fmt}, expert_parallel={expert_parallel}: first-token logits TP=2 vs TP=1 {split:.2e}")
    if fmt == "stored":
        assert split < 1e-4
    else:
        one, two = (rel_err(logits[(size, True)], logits[(1, False)]) for size in (1, 2))
        print(f"  against the unquantized model: TP=1 {one:.4f}, TP=2 {two:.4f}")
        assert 1e-5 < two < 0.1 and two < 2 * one + 1e-3
