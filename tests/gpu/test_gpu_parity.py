"""The parity of test_parity.py on CUDA: float32 tokens identical to transformers, bfloat16 logits
within 2e-2 relative. Run on the GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from tests.helpers import first_logits, hf_generate, hf_inputs, hf_model, rel_err
from tests.parity_cases import CASES, assert_matches

pytestmark = pytest.mark.gpu

GREEDY_32 = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


def cuda_pipe(path: str, dtype: str) -> Pipeline:
    return Pipeline.from_pretrained(path, device="cuda", dtype=dtype, num_kv_pages=4096)


@pytest.fixture(scope="module")
def cuda_fp32(checkpoint):
    return cuda_pipe(checkpoint, "float32")


@pytest.fixture(scope="module")
def reference_fp32(checkpoint):
    return hf_model(checkpoint, device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def cuda_bf16(checkpoint):
    return cuda_pipe(checkpoint, "bfloat16")


@pytest.fixture(scope="module")
def reference_bf16(checkpoint):
    return hf_model(checkpoint, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES))
def test_float32_on_cuda_matches_transformers(cuda_fp32, reference_fp32, checkpoint, case):
    assert_matches(cuda_fp32, reference_fp32, checkpoint, CASES[case](), device="cuda", logprob_tol=1e-3)


def test_float32_cuda_batch_equals_cpu(cuda_fp32, pipe):
    conversations = [case() for case in CASES.values()]
    on_gpu = [o.token_ids for o in cuda_fp32.chat(conversations, GREEDY_32)]
    on_cpu = [o.token_ids for o in pipe.chat(conversations, GREEDY_32)]
    assert on_gpu == on_cpu


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_logits_within_tolerance(cuda_bf16, reference_bf16, checkpoint, case):
    conversation = CASES[case]()
    inputs = hf_inputs(checkpoint, conversation, device="cuda")
    with torch.no_grad():
        ref = reference_bf16(**inputs).logits[0, -1].float()
    assert rel_err(first_logits(cuda_bf16, conversation), ref) <= 2e-2


def test_unaligned_mlp_widths_on_cuda_match_transformers(checkpoint_factory):
    """MLP widths padded to 128 at load (checkpoint: 100 and 90) still give transformers'
    logits and greedy tokens on CUDA, float32."""
    path = checkpoint_factory(vision={"intermediate_size": 100}, text={"intermediate_size": 90}, seed=7)
    pipe = cuda_pipe(path, "float32")
    assert pipe.model.vision.blocks[0].mlp.hidden == 128 and pipe.model.language.layers[0].mlp.hidden == 128
    conversation = CASES["two_images"]()
    inputs = hf_inputs(path, conversation, device="cuda")
    ref_logits, ref_tokens, _ = hf_generate(hf_model(path, device="cuda", dtype=torch.float32), inputs, 32)
    assert rel_err(first_logits(pipe, conversation), ref_logits) <= 1e-4
    assert pipe.chat(conversation, GREEDY_32)[0].token_ids == ref_tokens
    pipe.close()
