"""Qwen3-VL-MoE's experts on the CPU reference path: the layer against transformers' sparse MoE
block, routers that spread tokens over many experts, both 3D expert-tensor layouts (one tensor
per expert, and FP8, in `test_moe_fp8.py`), a tensor-parallel split checked against the experts' width,
and a traced prefill's hold on the experts' host code. Generation against transformers runs in
`test_families.py` with the other families, tensor parallelism in `test_tensor_parallel*.py`,
the fused kernels in `tests/gpu/test_gpu_moe.py`."""

from __future__ import annotations

import os

import pytest
import torch
from mmpipe.language.qwen3_moe import SparseMoE, qwen3_moe_text_config

from mmpipe import Pipeline, SamplingParams
from mmpipe.errors import CheckpointError, UnsupportedModelError
from mmpipe.weights import read_json
from tests.helpers import make_checkpoint
from tests.parity_cases import one_image, two_images

PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("moe")), family="qwen3_vl_moe")


def test_the_layer_equals_transformers_sparse_moe_block(checkpoint):
    """Same weights, random rows: the routing weights and the layer's output in float32."""
    from transformers import AutoConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    hf_config = AutoConfig.from_pretrained(checkpoint).text_config
    reference = Qwen3VLMoeTextSparseMoeBlock(hf_config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in reference.parameters():
            weight.normal_(0.0, 0.3)
    ours = SparseMoE(qwen3_moe_text_config(read_json(checkpoint, "config.json")))
    ours.gate.weight.data.copy_(reference.gate.weight)
    ours.experts.gate_up_proj.data.copy_(reference.experts.gate_up_proj)
    ours.experts.down_proj.data.copy_(reference.experts.down_proj)
    x = torch.randn(37, hf_config.hidden_size)
    with torch.no_grad():
        expected = reference(x[None])[0]
        _, scores, chosen = reference.gate(x)
        weights, ids = ours.route(x)
        assert torch.equal(ids.long(), chosen) and torch.equal(weights, scores)
        assert (ours(x) - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_tokens_spread_over_many_experts(checkpoint):
    """The tiny checkpoint's routers send a prompt's tokens to every expert, none taking most of
    them, and choose clearly: parity would not test the routing if every token chose the same
    few, nor hold if choices were near-ties."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    seen: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []  # each token's last chosen probability over the best unchosen
    original = SparseMoE.route

    def record(self, x):
        weights, ids = original(self, x)
        seen.append(torch.zeros(x.shape[0], self.gate.weight.shape[0], dtype=torch.bool).scatter_(1, ids.long(), True))
        ranked = torch.softmax(torch.nn.functional.linear(x, self.gate.weight), dim=-1).sort(dim=-1).values
        margins.append(ranked[:, -self.top_k] / ranked[:, -self.top_k - 1])
        return weights, ids

    SparseMoE.route = record
    try:
        pipe.chat(two_images(), PARAMS)
    finally:
        SparseMoE.route = original
        pipe.close()
    chosen = torch.cat([s for s in seen if s.shape[0] > 1])  # the prompt's steps
    share = chosen.float().mean(dim=0) / chosen.float().sum(dim=1).mean()
    assert (chosen.sum(dim=0) > 0).sum() == chosen.shape[1]  # every expert is chosen somewhere
    assert share.max() < 0.5
    assert torch.cat(margins).median() > 1.2  # clear choices, which no rounding difference flips


def test_the_published_expert_layout_loads_to_the_same_answers(checkpoint, tmp_path):
    """Qwen's files store each expert tensor with its last two dimensions swapped."""
    import shutil

    from safetensors.torch import load_file, save_file

    published = str(tmp_path / "published")
    shutil.copytree(checkpoint, published)
    file = os.path.join(published, "model.safetensors")
    tensors = load_file(file)
    swapped = {name: t.transpose(1, 2).contiguous() if ".experts." in name else t for name, t in tensors.items()}
    assert sum(".experts." in name for name in swapped) == 4  # two sparse layers, two tensors each
    save_file(swapped, file, metadata={"format": "pt"})
    answers = []
    for path in (checkpoint, published):
        pipe = Pipeline.from_pretrained(path, device="cpu")
        answers.append(pipe.chat(one_image(), PARAMS)[0])
        pipe.close()
    assert answers[0].token_ids == answers[1].token_ids and answers[0].logprobs == answers[1].logprobs
    bad = {name: t[:, :-1].contiguous() if name.endswith("experts.down_proj") else t for name, t in tensors.items()}
    save_file(bad, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.down_proj: shape"):
        Pipeline.from_pretrained(published, device="cpu")


def test_a_tensor_parallel_split_of_the_experts_is_checked(checkpoint):
    from mmpipe.models import check_tensor_parallel_split

    check_tensor_parallel_split(checkpoint, 2)  # the experts split (tests/unit/test_tensor_parallel*.py)
    with pytest.raises(UnsupportedModelError, match="the experts' width 48"):
        check_tensor_parallel_split(checkpoint, 32)


def test_the_expert_kernels_host_code_traces_once_for_every_token_count():
    """A traced prefill (`prefill_compiler="inductor"`, the token count dynamic up to
    max_prefill_tokens) holds the grouped path's host code: the tile lookup is read once as a
    constant (no file opened under the tracer) and the sort into expert blocks is an opaque op
    (inductor's own sort would bound the pair count). Equal to eager at every size."""
    import torch._dynamo

    from mmpipe.kernels import moe, moe_configs

    def host_part(ids):
        tiles = moe_configs.grouped_tiles(128, 768, 2048, torch.bfloat16, moe.PREFILL_ROWS)
        sorted_pairs, block_expert, total = moe.align(ids, 128, tiles.block_m)
        return sorted_pairs + 0, block_expert, total

    torch._dynamo.reset()
    traced = torch.compile(host_part, backend="inductor", fullgraph=True)  # as the prefill runner compiles
    for rows in (37, 5000, 8192):
        ids = torch.randint(0, 128, (rows, 8), dtype=torch.int32)
        torch._dynamo.mark_dynamic(ids, 0, min=2, max=8192)
        assert all(torch.equal(a, b) for a, b in zip(traced(ids), host_part(ids)))
    sorted_pairs, block_expert, total = host_part(ids)
    block = moe_configs.grouped_tiles(128, 768, 2048, torch.bfloat16, moe.PREFILL_ROWS).block_m
    assert sorted_pairs.numel() % block == 0 and block_expert.numel() == sorted_pairs.numel() // block
    real = sorted_pairs < ids.numel()
    assert torch.equal(sorted_pairs[real].long().sort().values, torch.arange(ids.numel()))  # every pair once
    assert torch.equal(ids.reshape(-1)[sorted_pairs[real].long()], block_expert.repeat_interleave(block)[real])
    assert total.item() == real.nonzero().max().item() // block * block + block  # the last live block's end
