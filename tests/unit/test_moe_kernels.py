"""The mixture-of-experts Triton kernels (`mmpipe.kernels.moe_kernels`) under the Triton
interpreter on the CPU, in float32 (the interpreter's bfloat16 products are not exact): routing
equal to softmax-top-k (a NaN row and an all-tied row still pick real experts), and both expert
paths equal to the per-expert loop for widths no tile divides, fewer pairs than experts, and one
expert per token, experts split over two ranks (expert parallelism) summing to the whole, and
FP8 experts with uneven tile scales against their dequantized weights
(skipped where Triton is not installed; on CUDA the same kernels run in
`tests/gpu/test_gpu_moe.py`). And the tuned-tile table's lookup, which needs no Triton."""

from __future__ import annotations

from tests.helpers import run_under_triton_interpreter

_SCRIPT = """
import json
import torch
from mmpipe.kernels import moe
from mmpipe.kernels.moe_configs import GroupedTiles, PairTiles
from mmpipe.kernels.moe_kernels import route_kernel
print("READY")
results = []
g = torch.Generator().manual_seed(0)
for experts, top_k, hidden, width, rows in ((16, 4, 72, 40, 5), (16, 4, 72, 40, 70), (128, 8, 64, 32, 9), (4, 1, 32, 16, 3)):
    x = torch.randn(rows, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(experts, hidden, width, generator=g) / width ** 0.5
    logits = torch.randn(rows, experts, generator=g) * 3
    logits[0] = float("nan")
    logits[-1] = 0.0
    weights = torch.empty(rows, top_k)
    ids = torch.empty(rows, top_k, dtype=torch.int32)
    block_e, block_k = 1 << (experts - 1).bit_length(), 1 << (top_k - 1).bit_length()
    route_kernel[(rows,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=block_k)
    ref_weights, ref_ids = moe.route_reference(logits[1:-1], top_k)
    routed = (torch.equal(ids[1:-1], ref_ids) and torch.allclose(weights[1:-1], ref_weights, atol=1e-6)
              and ids[0].unique().numel() == top_k and ids[-1].tolist() == list(range(top_k)))
    expected = moe.experts_reference(x, gate_up, down, ref_weights.new_tensor(weights), ids)
    scale = expected.abs().max().item()
    pair = moe.pair_experts(x, gate_up, down, weights, ids, (PairTiles(8, 32, 4), PairTiles(16, 32, 4))).total()
    grouped = moe.grouped_experts(x, gate_up, down, weights, ids, GroupedTiles(16, 32, 32, 32, 32, 4, 2)).total()
    if experts == 16:  # expert parallelism: two ranks of 8 experts each, their sums added
        empty = torch.empty  # (every slot of the sums written: fresh buffers start as NaN)
        torch.empty = lambda *a, **k: (lambda t: t.fill_(float("nan")) if t.is_floating_point() else t)(empty(*a, **k))
        half = experts // 2
        pair, grouped = (sum(fn(x, gate_up[r * half:(r + 1) * half], down[r * half:(r + 1) * half], weights,
                                moe.local_ids(ids, r * half, half)) for r in range(2))
                         for fn in (lambda *a: moe.pair_experts(*a, (PairTiles(8, 32, 4), PairTiles(16, 32, 4))).total(),
                                    lambda *a: moe.grouped_experts(*a, GroupedTiles(16, 32, 32, 32, 32, 4, 2)).total()))
        torch.empty = empty
    results.append([experts, rows, routed, (pair - expected).abs().max().item() / scale,
                    (grouped - expected).abs().max().item() / scale])
from mmpipe.layers.fp8_experts import Fp8Experts
for experts, top_k, hidden, width, rows in ((8, 2, 256, 128, 3), (8, 2, 256, 128, 40)):  # FP8 experts
    x = torch.randn(rows, hidden, generator=g)
    fp8 = Fp8Experts.from_weights(torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5,
                                  torch.randn(experts, hidden, width, generator=g) / width ** 0.5)
    fp8.gate_up_scale.mul_(torch.rand(fp8.gate_up_scale.shape, generator=g) + 0.5)  # uneven tiles
    fp8.down_scale.mul_(torch.rand(fp8.down_scale.shape, generator=g) + 0.5)
    weights, ids = moe.route_reference(torch.randn(rows, experts, generator=g) * 3, top_k)
    expected = moe.experts_reference(x, *fp8.dequantized(), weights, ids)
    scale = expected.abs().max().item()
    args = (x, fp8.gate_up_proj, fp8.down_proj, weights, ids)
    pair = moe.pair_experts(*args, (PairTiles(16, 64, 4), PairTiles(32, 128, 4)), scales=fp8.scales()).total()
    grouped = moe.grouped_experts(*args, GroupedTiles(16, 64, 128, 32, 128, 4, 2), scales=fp8.scales()).total()
    results.append([experts, rows, True, (pair - expected).abs().max().item() / scale,
                    (grouped - expected).abs().max().item() / scale])
print("RESULTS " + json.dumps(results))
"""


def test_routing_and_both_expert_paths_equal_the_references():
    results = run_under_triton_interpreter(_SCRIPT)
    assert len(results) == 6
    for experts, rows, routed, pair_error, grouped_error in results:
        assert routed, (experts, rows)
        assert pair_error < 1e-5 and grouped_error < 1e-5, (experts, rows, pair_error, grouped_error)


def test_tuned_tiles_are_read_by_row_count_and_saved_entries_replace_cached_ones(tmp_path, monkeypatch):
    """A step takes the entry of the smallest tuned row count >= its rows (the largest above them
    all); a shape without an entry takes the defaults; a saved sweep is read at the next lookup,
    though lookups are cached (an eager step makes one per layer)."""
    import torch

    from mmpipe.kernels import moe_configs as mc

    monkeypatch.setattr(mc, "tuned_path", lambda: str(tmp_path / "moe_configs.json"))
    mc.forget_tuned()
    try:
        shape = (8, 48, 64, torch.float32)
        assert mc.grouped_tiles(*shape, 100) == mc.default_grouped(100, torch.float32)
        small, large = mc.GroupedTiles(16, 32, 32, 32, 32, 4, 2), mc.GroupedTiles(64, 64, 32, 64, 32, 8, 3)
        pair = (mc.PairTiles(4, 256, 4), mc.PairTiles(32, 512, 8))
        mc.save_entry(mc.config_key(*shape, "cpu"), pair, {32: small, 512: large})
        assert [mc.grouped_tiles(*shape, rows) for rows in (1, 32, 33, 512, 4096)] == [small, small, large, large, large]
        assert mc.pair_tiles(*shape) == pair
        assert mc.grouped_tiles(8, 96, 64, torch.float32, 1) == mc.default_grouped(1, torch.float32)  # another width
    finally:
        mc.forget_tuned()
