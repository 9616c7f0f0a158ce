"""The fused expert kernels (`mmpipe.kernels.moe`) on CUDA (`pytest -m gpu`): routing equal to
PyTorch's softmax-top-k, both expert paths against a plain per-expert loop for row counts on both
sides of every switch, tokens reaching many experts; experts split over ranks (expert
parallelism) adding up to the whole; replayed inside CUDA graphs with new rows
(new routing) equal to eager; prefill pieces compiled by inductor (the token count traced
dynamic) equal to the eager prefill; and `mmpipe bench moe`'s tuning sweep writing entries that
the kernels then read. Generation against transformers runs in `test_gpu_families.py`."""

from __future__ import annotations

import json

import pytest
import torch

from mmpipe import Pipeline, SamplingParams
from mmpipe.config import GraphConfig
from mmpipe.kernels import moe, moe_configs
from tests.helpers import make_checkpoint, replays_equal_eager
from tests.parity_cases import CASES, one_image

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 256, 96  # WIDTH: no multiple of any tile, so every mask is used


def layer(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=CUDA, generator=g) / HIDDEN ** 0.5
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, device=CUDA, generator=g) / WIDTH ** 0.5
    router = torch.randn(EXPERTS, HIDDEN, device=CUDA, generator=g) * 3 / HIDDEN ** 0.5  # a spread of choices
    return gate_up.to(dtype), down.to(dtype), router.to(dtype)


def rows(count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(count, HIDDEN, device=CUDA, generator=g).to(dtype)


def test_routing_equals_softmax_top_k():
    _, _, router = layer(torch.float32)
    logits = rows(300, torch.float32, 1) @ router.T
    weights, ids = moe.route(logits, TOP_K)
    ref_weights, ref_ids = moe.route_reference(logits, TOP_K)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    assert ids.unique().numel() > EXPERTS // 2  # the rows reach many experts
    logits[3] = float("nan")  # a warm-up forward's garbage rows still index real experts
    logits[4] = 0.0  # all experts tied (a warm-up forward of zeros): the first TOP_K
    weights, ids = moe.route(logits, TOP_K)
    assert ids.min() >= 0 and ids.max() < EXPERTS and ids[3].unique().numel() == TOP_K
    assert ids[4].tolist() == list(range(TOP_K)) and torch.allclose(weights[4], torch.full_like(weights[4], 1 / TOP_K))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 2, 4, 5, 33, 257])
@pytest.mark.parametrize("path", ["pair", "grouped"])
def test_expert_paths_equal_the_per_expert_loop(dtype, count, path):
    gate_up, down, router = layer(dtype)
    x = rows(count, dtype, count)
    weights, ids = moe.route(x @ router.T, TOP_K)
    with torch.no_grad():
        got = moe.experts(x, gate_up, down, weights, ids, path=path).total().float()
        expected = moe.experts_reference(x.double(), gate_up.double(), down.double(), weights.double(), ids)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("count", [1, 4, 5, 300])
@pytest.mark.parametrize("path", ["pair", "grouped"])
def test_experts_split_over_ranks_sum_to_the_whole(fp8, count, path, monkeypatch):
    """Expert parallelism: four ranks of 32 experts each (rows choosing other ranks' experts get
    nothing from a rank) add up to all 128 at once, plain or FP8; fresh buffers start as NaN, so
    a slot of the sums left unwritten shows."""
    from mmpipe.layers.fp8_experts import Fp8Experts

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                         else t)(empty(*a, **k)))

    gate_up, down, router = layer(torch.bfloat16)
    width = WIDTH
    if fp8:  # FP8 experts need whole 128-wide tiles
        width = 128
        gate_up = torch.cat([gate_up, gate_up[:, :64]], dim=1)[:, :256].contiguous()
        down = torch.cat([down, down[:, :, :32]], dim=2).contiguous()
        held = Fp8Experts.from_weights(gate_up, down)
        gate_up, down, scales = held.gate_up_proj, held.down_proj, held.scales()
    x = rows(count, torch.bfloat16, count)
    weights, ids = moe.route(x @ router.T, TOP_K)

    def part(first: int, count_: int):
        part_scales = tuple(s[first:first + count_] for s in scales) if fp8 else None
        return moe.experts(x, gate_up[first:first + count_], down[first:first + count_], weights,
                           moe.local_ids(ids, first, count_), path=path, scales=part_scales).total().float()

    whole = part(0, EXPERTS)
    split = sum(part(r * 32, 32) for r in range(4))
    assert down.shape[2] == width
    assert (split - whole).abs().max() <= 1e-2 * whole.abs().max()
    assert len({int(e) // 32 for e in ids.unique()}) > 1  # the rows chose experts of several ranks


@pytest.mark.parametrize("count", [1, 4, 48])
def test_experts_replay_in_a_cuda_graph(count):
    """Captured once, replayed with new rows (so new routing): equal to the same call run eagerly."""
    gate_up, down, router = layer(torch.bfloat16)
    static = rows(count, torch.bfloat16, 0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.route(x @ router.T, TOP_K)
        path = "pair" if count <= moe.PAIR_ROWS else "grouped"
        return moe.experts(x, gate_up, down, weights, ids, path=path).total()

    replays_equal_eager(forward, static, [rows(count, torch.bfloat16, seed) for seed in (1, 2, 3)])


def test_the_tuning_sweep_writes_entries_the_kernels_read(tmp_path, monkeypatch):
    from mmpipe.app.bench.moe import tune

    path = tmp_path / "moe_configs.json"
    monkeypatch.setattr(moe_configs, "tuned_path", lambda: str(path))
    moe_configs.forget_tuned()
    try:
        entry = tune(EXPERTS, WIDTH, HIDDEN, TOP_K, torch.bfloat16, buckets=(8, 64), candidates=2)
        saved = json.loads(path.read_text())
        key = moe_configs.config_key(EXPERTS, WIDTH, HIDDEN, torch.bfloat16, torch.cuda.get_device_name())
        assert saved[key] == entry
        moe_configs.forget_tuned()
        chosen = moe_configs.grouped_tiles(EXPERTS, WIDTH, HIDDEN, torch.bfloat16, 64)
        assert chosen == moe_configs.GroupedTiles(**entry["grouped"]["64"])
    finally:
        moe_configs.forget_tuned()


def test_inductor_prefill_pieces_hold_the_experts(tmp_path):
    path = make_checkpoint(str(tmp_path / "moe"), family="qwen3_vl_moe")
    kw = dict(device="cuda", dtype="float32", num_kv_pages=1024, max_running_requests=4)
    compiled = Pipeline.from_pretrained(path, graph_mode="piecewise", prefill_compiler="inductor",
                                        prefill_graph=GraphConfig(buckets=(64, 256)),
                                        compile_cache_dir=str(tmp_path / "cache"), **kw)
    eager = Pipeline.from_pretrained(path, graph_mode="none", **kw)
    traced = compiled.stats()["prefill"]["detail"]["graphs_seen"]  # (start-up's, as for every family)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0, logprobs=5)
    for conversation in (CASES["text"](), one_image()):
        ours, ref = compiled.chat(conversation, params)[0], eager.chat(conversation, params)[0]
        assert ours.token_ids == ref.token_ids
        assert max(abs(a[t] - b[t]) for a, b in zip(ours.logprobs, ref.logprobs) for t in b) <= 1e-4
    stats = compiled.stats()["prefill"]
    assert stats["graph_runs"] >= 2 and stats["detail"]["graphs_seen"] == traced  # no request traced again
    compiled.close()
    eager.close()
