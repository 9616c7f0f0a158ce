"""FP8 experts on CUDA (`pytest -m gpu`): both expert paths with block-scaled FP8 weights (uneven
tile scales) against the per-expert loop over the same weights dequantized; replayed in a CUDA
graph; an FP8 checkpoint in the Qwen releases' layout (one tensor per expert and projection)
keeping its experts in FP8 with every graph mode giving eager's tokens, close to its weights
dequantized by hand; `quantization="fp8"` quantizing a bfloat16 model's experts at load; and
`mmpipe bench moe --fp8 --tune` saving tiles under the FP8 experts' own key."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from mmpipe.kernels import moe, moe_configs
from mmpipe.layers.fp8_experts import Fp8Experts
from tests.helpers import (
    first_logits,
    fp8_checkpoint_in_every_graph_mode,
    make_checkpoint,
    rel_err,
    replays_equal_eager,
)
from tests.parity_cases import one_image, two_images

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, WIDTH = 64, 8, 512, 256
# Experts of whole 128 x 128 tiles, and attention projections the FP8 GEMMs take.
WIDE_MOE = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                                "mrope_interleaved": True}}


def fp8_layer(seed: int = 0) -> tuple[Fp8Experts, torch.Tensor]:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    experts = Fp8Experts.from_weights(torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=CUDA, generator=g) / HIDDEN ** 0.5,
                                      torch.randn(EXPERTS, HIDDEN, WIDTH, device=CUDA, generator=g) / WIDTH ** 0.5)
    for scale in experts.scales():  # uneven tiles: a scale read from the wrong tile shows
        scale.mul_(torch.rand(scale.shape, device=CUDA, generator=g) + 0.5)
    router = torch.randn(EXPERTS, HIDDEN, device=CUDA, generator=g) * 3 / HIDDEN ** 0.5
    return experts, router


def rows(count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(count, HIDDEN, device=CUDA, generator=g).to(dtype)


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows quantized to FP8 per 128 columns and back (a block-scaled layer's activations)."""
    groups = x.reshape(x.shape[0], -1, moe.SCALE_BLOCK)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((groups / scale).to(torch.float8_e4m3fn).double() * scale).reshape(x.shape)


def fp8_activations_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                              ids: torch.Tensor) -> torch.Tensor:
    """The per-expert loop with the grouped GEMM's half-precision arithmetic: each product's
    input quantized per 128 columns, the SiLU product stored in x's dtype."""
    dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=torch.float64, device=x.device)
    dense.scatter_(1, ids.long(), weights.double())
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xq = quantized_rows(x.double())
    for e in range(gate_up.shape[0]):
        gate, up = (xq @ gate_up[e].T).chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate.to(x.dtype).double()).to(x.dtype).double() * up.to(x.dtype).double())
        out += quantized_rows(act.to(x.dtype).double()) @ down[e].T * dense[:, e:e + 1]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 3, 4, 5, 33, 257])
@pytest.mark.parametrize("path", ["pair", "grouped"])
def test_fp8_expert_paths_equal_the_loop_over_their_dequantized_weights(dtype, count, path):
    """The pair kernels and float32 rows: weights-only FP8, against the dequantized weights. The
    grouped GEMM with bfloat16 rows quantizes them per 128 columns: against that arithmetic, and
    within FP8's activation error of the weights-only result."""
    experts, router = fp8_layer()
    x = rows(count, dtype, count)
    weights, ids = moe.route(x @ router.T.to(dtype), TOP_K)
    with torch.no_grad():
        got = moe.experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, path=path,
                          scales=experts.scales()).total().float()
        plain = moe.experts_reference(x.double(), *experts.dequantized(torch.float64), weights.double(), ids)
        expected = plain
        if path == "grouped" and dtype == torch.bfloat16:
            expected = fp8_activations_reference(x, *experts.dequantized(torch.float64), weights, ids)
            assert 1e-3 < rel_err(expected, plain) < 0.1  # the activations' quantization is there, and small
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    if path == "grouped" and dtype == torch.bfloat16:  # FP8 roundings of the rows flip on bfloat16 differences
        assert rel_err(got, expected) <= 2e-2
        tolerance = 1e-1
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("count", [1, 48])
def test_fp8_experts_replay_in_a_cuda_graph(count):
    experts, router = fp8_layer(1)
    static = rows(count, torch.bfloat16, 0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.route(x @ router.T.bfloat16(), TOP_K)
        path = "pair" if count <= moe.PAIR_ROWS else "grouped"
        return moe.experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, path=path,
                           scales=experts.scales()).total()

    replays_equal_eager(forward, static, [rows(count, torch.bfloat16, seed) for seed in (1, 2)])


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("wide_moe")), family="qwen3_vl_moe", text=WIDE_MOE)


def test_an_fp8_moe_checkpoint_keeps_its_experts_in_fp8_in_every_graph_mode(wide_moe, tmp_path):
    from tests.moe_checkpoints import fp8_per_expert

    quantized, reference = fp8_per_expert(wide_moe, tmp_path)
    fp8_checkpoint_in_every_graph_mode(quantized, reference, [one_image(), two_images()],
                                       "and 2 layers of experts kept in FP8")
    pipe = Pipeline.from_pretrained(quantized, device="cuda", dtype="float32", graph_mode="none", num_kv_pages=64)
    assert sum(isinstance(m, Fp8Experts) for m in pipe.model.language.modules()) == 2
    pipe.close()


def test_runtime_fp8_quantizes_the_experts_and_keeps_graphs_exact(wide_moe):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0)
    tokens, logits = {}, {}
    for quantization, mode in ((None, "none"), ("fp8", "none"), ("fp8", "full_and_piecewise")):
        pipe = Pipeline.from_pretrained(wide_moe, device="cuda", dtype="bfloat16", graph_mode=mode,
                                        quantization=quantization, num_kv_pages=512, max_running_requests=4)
        if quantization:
            assert "2 layers of experts (128x128 block scales)" in pipe.model.quantization, pipe.model.quantization
        tokens[quantization, mode] = [o.token_ids for o in pipe.chat([one_image(), two_images()], params)]
        logits[quantization, mode] = first_logits(pipe, one_image())
        pipe.close()
    assert tokens["fp8", "none"] == tokens["fp8", "full_and_piecewise"]
    assert 1e-4 < rel_err(logits["fp8", "none"], logits[None, "none"]) < 0.1


def test_the_tuning_sweep_keeps_fp8_tiles_under_their_own_key(tmp_path, monkeypatch):
    from mmpipe.app.bench.moe import tune

    path = tmp_path / "moe_configs.json"
    monkeypatch.setattr(moe_configs, "tuned_path", lambda: str(path))
    moe_configs.forget_tuned()
    try:
        entry = tune(EXPERTS, WIDTH, HIDDEN, TOP_K, torch.bfloat16, buckets=(8, 64), candidates=2, fp8=True)
        assert entry["grouped"]["64"]["up_k"] == entry["grouped"]["64"]["down_k"] == moe.SCALE_BLOCK
        moe_configs.forget_tuned()
        chosen = moe_configs.grouped_tiles(EXPERTS, WIDTH, HIDDEN, torch.bfloat16, 64, fp8=True)
        assert chosen == moe_configs.GroupedTiles(**entry["grouped"]["64"])
        assert moe_configs.grouped_tiles(EXPERTS, WIDTH, HIDDEN, torch.bfloat16, 64) == moe_configs.default_grouped(
            64, torch.bfloat16)  # the bfloat16 experts' entry is another
    finally:
        moe_configs.forget_tuned()
