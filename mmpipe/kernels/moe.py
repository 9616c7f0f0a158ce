"""A mixture-of-experts layer's routing and experts: fused kernels on CUDA, PyTorch elsewhere.

`route(logits, top_k)`: each row's softmax over its experts in float32, the `top_k` largest
renormalised to sum to one -> (weights [rows, top_k] float32, expert ids [rows, top_k] int32).

`experts(x, gate_up, down, weights, ids)`: each row's sum over its chosen experts of
weight * down(silu(gate) * up), with the experts' weights as two 3D tensors, `gate_up`
[experts, 2 * width, hidden] (gate rows, then up rows) and `down` [experts, hidden, width].
Under expert parallelism a rank holds some of the experts and sums only over those: ids from
`local_ids`, where another rank's expert is `experts` (one past the rank's last), add nothing.

On CUDA (`moe_kernels`) nothing waits for the host and no shape depends on the routing, so CUDA
graphs hold both paths:
- up to `PAIR_ROWS` rows (decode), the pair kernels: each chosen expert's weights are read once
  per row that chose it, and no other expert's;
- more rows, the grouped GEMM: `align` sorts the pairs by expert into blocks of BLOCK_M rows on
  the device, sized for the worst case from the row count alone, then two grouped products run
  on the tensor cores.
Either way a row's TOP_K scaled products come back as `PartialSums` (float32 slices that the
residual add after the layer adds in choice order), so no kernel combines them.
Their tile sizes come from `moe_configs`. As with `gemv`, the path and tiles follow the row
count: a decode batch padded to its graph bucket computes as the eager step of that bucket does.

FP8 experts (`scales`: the float32 scale of every 128 x 128 tile of each expert's gate_up and down
weights, `[experts, rows / 128, columns / 128]`) run in the same kernels, their weights widened in
registers or, in the grouped GEMM with half-precision rows, multiplied in FP8 with the rows
quantized per 128 columns (`moe_kernels`); the reference dequantizes them first
(`dequantize_experts`).

Elsewhere, `experts` is the reference: every expert over every row, weighted by a routing weight
that is zero where a row did not choose the expert, added in expert order as transformers adds
them (exact against it in float32; it costs every expert's work, so only the CPU runs it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpipe.kernels import gemv, tl, triton
from mmpipe.kernels.fp8_quant import quantize_per_group
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2
from mmpipe.kernels.moe_configs import GroupedTiles, PairTiles, grouped_tiles, pair_tiles
from mmpipe.kernels.partial_sums import PartialSums

__all__ = ["PAIR_ROWS", "PREFILL_ROWS", "SCALE_BLOCK", "align", "dequantize_experts", "experts", "experts_reference",
           "grouped_experts", "local_ids", "pair_experts", "route", "route_reference"]

PAIR_ROWS = 4  # up to this many rows the pair kernels run (decode at small batches)
PREFILL_ROWS = 4096  # the row count whose tiles every prefill step takes
SCALE_BLOCK = 128  # FP8 experts: one scale per SCALE_BLOCK x SCALE_BLOCK tile of a weight

Scales = tuple[torch.Tensor, torch.Tensor]  # FP8 experts' (gate_up scales, down scales)


def _on_kernels(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def route_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), chosen.to(torch.int32)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32, expert ids int32), each [rows, top_k], best first."""
    if not _on_kernels(logits):
        return route_reference(logits, top_k)
    return _route_cuda(logits, top_k)


# The CUDA paths are custom ops: opaque to a traced prefill (`prefill_compiler="inductor"`), which
# runs them as they are instead of rewriting their Triton launches.

@torch.library.custom_op("mmpipe::moe_route", mutates_args=())
def _route_cuda(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mmpipe.kernels.moe_kernels import route_kernel

    rows, num_experts = logits.shape
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    # While a start-up pass only compiles kernels (`launch.compiling_only`), this one does not run
    # but `align`'s PyTorch ops do, indexing by the ids: they must be real experts even then.
    ids = (torch.zeros if launch.compiling_only() else torch.empty)(rows, top_k, dtype=torch.int32,
                                                                      device=logits.device)
    if rows:
        launch(route_kernel, (rows,), logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
               BLOCK_E=next_power_of_2(num_experts), BLOCK_K=next_power_of_2(top_k), num_warps=4)
    return weights, ids


@_route_cuda.register_fake
def _(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return logits.new_empty(rows, top_k, dtype=torch.float32), logits.new_empty(rows, top_k, dtype=torch.int32)


def _fake_sums(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return x.new_empty(ids.shape[1], x.shape[0], x.shape[1], dtype=torch.float32)


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 experts [experts, rows, columns] times their tile scales, in `dtype`."""
    full = scale.repeat_interleave(SCALE_BLOCK, 1).repeat_interleave(SCALE_BLOCK, 2)
    return (weight.float() * full[:, :weight.shape[1], :weight.shape[2]]).to(dtype)


def local_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Expert parallelism: global expert ids as this rank's (it holds experts [first, first +
    count)), `count` for another rank's: `experts` then adds nothing for those."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, scales: Scales | None = None) -> torch.Tensor:
    if scales is not None:
        gate_up, down = dequantize_experts(gate_up, scales[0], x.dtype), dequantize_experts(down, scales[1], x.dtype)
    dense = torch.zeros(x.shape[0], gate_up.shape[0] + 1, dtype=x.dtype, device=x.device)  # (+1: other ranks')
    dense.scatter_(1, ids.long(), weights.to(x.dtype))
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, down[e]) * dense[:, e:e + 1]
    return out


def experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor, path: str | None = None, scales: Scales | None = None) -> torch.Tensor | PartialSums:
    """[rows, hidden] in x's dtype; on CUDA as `PartialSums`, one float32 slice per choice (see the
    module docstring), or under tracing their sum. `path` ("pair", "grouped"; default: the pair
    kernels for a decode step of up to `PAIR_ROWS` rows) picks the CUDA kernels. A prefill step
    always takes the grouped GEMM with one set of tiles, so an eager prefill and the piecewise
    prefill (traced once for every size) compute the same. `scales`: the experts are FP8."""
    if not _on_kernels(x):
        return experts_reference(x, gate_up, down, weights, ids, scales)
    decode = gemv.in_decode_step()
    if path is None:
        path = "pair" if decode and x.shape[0] <= PAIR_ROWS else "grouped"
    if path == "pair":
        return pair_experts(x, gate_up, down, weights, ids, scales=scales)
    rows = x.shape[0] if decode else PREFILL_ROWS
    tiles = grouped_tiles(gate_up.shape[0], down.shape[2], x.shape[1], x.dtype, rows, scales is not None)
    out = grouped_experts(x, gate_up, down, weights, ids, tiles, scales)
    # A traced prefill takes the slices' sum as a tensor: the same additions in the same order as
    # the norm kernel's (`PartialSums.total`), which inductor does not take partial sums into.
    return out.total() if torch.compiler.is_compiling() else out


def _check_pair_scaled(scales: Scales | None, *block_ns: int) -> None:
    """A pair program's rows of FP8 experts lie in one block of scales."""
    if scales is not None and any(SCALE_BLOCK % n for n in block_ns):
        raise ValueError(f"FP8 experts take pair tiles of rows that divide {SCALE_BLOCK}, not {block_ns}")


def _check_grouped_scaled(scales: Scales | None, *block_ks: int) -> None:
    """The grouped GEMM takes FP8 experts one block of scales (128 columns of K) a step."""
    if scales is not None and any(k != SCALE_BLOCK for k in block_ks):
        raise ValueError(f"FP8 experts take grouped tiles of {SCALE_BLOCK} columns of K a step, not {block_ks}")


def _scale_args(scales: torch.Tensor | None, weights: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the scales, their expert and row-block strides); for plain experts a stand-in never read."""
    return (weights, 0, 0) if scales is None else (scales, scales.stride(0), scales.stride(1))


def pair_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, tiles: tuple[PairTiles, PairTiles] | None = None,
                 scales: Scales | None = None) -> PartialSums:
    """The few-row path on CUDA (`tiles`: the two kernels', default `pair_tiles`)."""
    up, dn = tiles or pair_tiles(gate_up.shape[0], down.shape[2], x.shape[1], x.dtype, scales is not None)
    _check_pair_scaled(scales, up.block_n, dn.block_n)
    up_scales, down_scales = scales if scales is not None else (None, None)
    sums = _pair_sums(x, gate_up, down, weights, ids, up_scales, down_scales, up.block_n, up.block_k, up.warps,
                      dn.block_n, dn.block_k, dn.warps)
    return PartialSums(sums, x.dtype)


@torch.library.custom_op("mmpipe::moe_pair_experts", mutates_args=())
def _pair_sums(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor, up_scales: torch.Tensor | None, down_scales: torch.Tensor | None, up_n: int,
               up_k: int, up_warps: int, down_n: int, down_k: int, down_warps: int) -> torch.Tensor:
    from mmpipe.kernels.moe_kernels import pair_down_kernel, pair_gate_up_kernel

    rows, hidden = x.shape
    experts, top_k, width = gate_up.shape[0], ids.shape[1], down.shape[2]
    act = torch.empty(rows * top_k, width, dtype=x.dtype, device=x.device)
    sums = torch.empty(top_k, rows, hidden, dtype=torch.float32, device=x.device)
    scaled = up_scales is not None
    up_s, up_se, up_sn = _scale_args(up_scales, weights)
    down_s, down_se, down_sn = _scale_args(down_scales, weights)
    if rows:
        launch(pair_gate_up_kernel, (rows * top_k, cdiv(width, up_n)), x, gate_up, up_s, ids, act, experts, hidden,
               width,
               x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), up_se, up_sn, TOP_K=top_k,
               BLOCK_N=up_n, BLOCK_K=up_k, SCALED=scaled, num_warps=up_warps)
        launch(pair_down_kernel, (rows * top_k, cdiv(hidden, down_n)), act, down, down_s, ids, weights, sums,
               experts, hidden, width, act.stride(0), down.stride(0), down.stride(1), sums.stride(0), sums.stride(1), down_se,
               down_sn, TOP_K=top_k, BLOCK_N=down_n, BLOCK_K=down_k, SCALED=scaled, num_warps=down_warps)
    return sums


_pair_sums.register_fake(lambda x, gate_up, down, weights, ids, *rest: _fake_sums(x, ids))


@torch.library.custom_op("mmpipe::moe_align", mutates_args=())
def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs (row * top_k + choice) sorted by expert, each expert's run padded to a multiple of
    `block_m` with the sentinel `ids.numel()`: (sorted pairs int32 [most], the expert of every block
    int32 [most / block_m], the padded total int32 [1]). `most` is the worst case of the pair
    count alone (rounded up to whole blocks), so the shapes never depend on the routing; blocks
    past the total are not run. An opaque op to the compiler: a traced prefill keeps its token
    count dynamic (inductor's own sort would bound it) and runs exactly this."""
    flat = ids.reshape(-1).long()
    pairs = flat.shape[0]
    order_experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    first_raw = counts.cumsum(0) - counts
    rank = torch.arange(pairs, device=ids.device) - first_raw[order_experts]
    most = _most(pairs, num_experts, block_m)
    sorted_pairs = torch.full((most,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, (ends - padded)[order_experts] + rank, order.to(torch.int32))
    starts = torch.arange(0, most, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:].to(torch.int32)


def _most(pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for `pairs` pairs whatever their routing: each expert reached may pad block_m - 1."""
    most = pairs + torch.sym_min(num_experts, pairs) * (block_m - 1)
    return (most + block_m - 1) // block_m * block_m


@align.register_fake
def _(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    most = _most(ids.numel(), num_experts, block_m)
    return (ids.new_empty(most, dtype=torch.int32), ids.new_empty(most // block_m, dtype=torch.int32),
            ids.new_empty(1, dtype=torch.int32))


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, tiles: GroupedTiles, scales: Scales | None = None) -> PartialSums:
    """The many-row path on CUDA, with these tiles."""
    _check_grouped_scaled(scales, tiles.up_k, tiles.down_k)
    up_scales, down_scales = scales if scales is not None else (None, None)
    sums = _grouped_sums(x, gate_up, down, weights, ids, up_scales, down_scales, tiles.block_m, tiles.up_n,
                         tiles.up_k, tiles.down_n, tiles.down_k, tiles.warps, tiles.stages)
    return PartialSums(sums, x.dtype)


@torch.library.custom_op("mmpipe::moe_grouped_experts", mutates_args=())
def _grouped_sums(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, up_scales: torch.Tensor | None, down_scales: torch.Tensor | None, block_m: int,
                  up_n: int, up_k: int, down_n: int, down_k: int, warps: int, stages: int) -> torch.Tensor:
    from mmpipe.kernels.moe_kernels import grouped_down_kernel, grouped_gate_up_kernel

    rows, hidden = x.shape
    num_experts, top_k, width = gate_up.shape[0], ids.shape[1], down.shape[2]
    pairs = rows * top_k
    sorted_pairs, block_expert, total = align(ids, num_experts + 1, block_m)  # (+1: other ranks' experts)
    blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    sums = torch.empty(top_k, rows, hidden, dtype=torch.float32, device=x.device)
    if not rows:
        return sums
    scaled = up_scales is not None
    fp8_rows = scaled and not ieee  # half-precision rows meet FP8 experts on the FP8 tensor cores
    up_s, up_se, up_sn = _scale_args(up_scales, weights)
    down_s, down_se, down_sn = _scale_args(down_scales, weights)
    a, a_scales, stride_as = _rows_for(x, fp8_rows, weights)
    launch(grouped_gate_up_kernel, (blocks, cdiv(width, up_n)), a, a_scales, gate_up, up_s, sorted_pairs,
           block_expert, total, act, pairs, num_experts, hidden, width, a.stride(0), stride_as, gate_up.stride(0),
           gate_up.stride(1), act.stride(0), up_se, up_sn, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=up_n,
           BLOCK_K=up_k, IEEE=ieee, SCALED=scaled, FP8_ROWS=fp8_rows, num_warps=warps, num_stages=stages)
    a, a_scales, stride_as = _rows_for(act, fp8_rows, weights)
    launch(grouped_down_kernel, (blocks, cdiv(hidden, down_n)), a, a_scales, down, down_s, sorted_pairs,
           block_expert, total, weights, sums, pairs, num_experts, hidden, width, a.stride(0), stride_as, down.stride(0),
           down.stride(1), sums.stride(0), sums.stride(1), down_se, down_sn, TOP_K=top_k, BLOCK_M=block_m,
           BLOCK_N=down_n, BLOCK_K=down_k, IEEE=ieee, SCALED=scaled, FP8_ROWS=fp8_rows,
           OUT_DTYPE=getattr(tl, str(x.dtype).removeprefix("torch.")), num_warps=warps, num_stages=stages)
    return sums


def _rows_for(x: torch.Tensor, fp8: bool, stand_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A grouped product's rows: (as they are, a stand-in never read, 0), or quantized to FP8 per
    row and 128 columns (values, scales [rows, columns / 128] stored row by row, their row stride)."""
    if not fp8:
        return x, stand_in, 0
    values, scales = quantize_per_group(x, SCALE_BLOCK)
    scales = scales.contiguous()
    return values, scales, scales.stride(0)


_grouped_sums.register_fake(lambda x, gate_up, down, weights, ids, *rest: _fake_sums(x, ids))
