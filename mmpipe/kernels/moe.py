"""A mixture-of-experts layer's routing and experts: fused kernels on CUDA, PyTorch elsewhere.

`route(logits, top_k)`: each row's softmax over its experts in float32, the `top_k` largest
renormalised to sum to one -> (weights [rows, top_k] float32, expert ids [rows, top_k] int32).

`experts(x, gate_up, down, weights, ids)`: each row's sum over its chosen experts of
weight * down(silu(gate) * up), with the experts' weights as two 3D tensors, `gate_up`
[experts, 2 * width, hidden] (gate rows, then up rows) and `down` [experts, hidden, width].

On CUDA (`moe_kernels`) nothing waits for the host and no shape depends on the routing, so CUDA
graphs hold both paths:
- up to `PAIR_ROWS` rows (decode), the pair kernels: each chosen expert's weights are read once
  per row that chose it, and no other expert's;
- more rows, the grouped GEMM: `align` sorts the pairs by expert into blocks of BLOCK_M rows on
  the device, sized for the worst case from the row count alone, then two grouped products run
  on the tensor cores.
Either way a row's TOP_K scaled products come back as `PartialSums` (float32 slices that the
residual add after the layer adds in choice order), so no kernel combines them.
Their tile sizes come from `moe_configs`.

Elsewhere, `experts` is the reference: every expert over every row, weighted by a routing weight
that is zero where a row did not choose the expert, added in expert order as transformers adds
them (exact against it in float32; it costs every expert's work, so only the CPU runs it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpipe.kernels import gemv, triton
from mmpipe.kernels.launch import cdiv, launch, next_power_of_2
from mmpipe.kernels.moe_configs import GroupedTiles, PairTiles, grouped_tiles, pair_tiles
from mmpipe.kernels.partial_sums import PartialSums

__all__ = ["PAIR_ROWS", "PREFILL_ROWS", "align", "experts", "experts_reference", "grouped_experts", "pair_experts",
           "route", "route_reference"]

PAIR_ROWS = 4  # up to this many rows the pair kernels run (decode at small batches)
PREFILL_ROWS = 4096  # the row count whose tiles every prefill step takes


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


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    dense.scatter_(1, ids.long(), weights.to(x.dtype))
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, down[e]) * dense[:, e:e + 1]
    return out


def experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor, path: str | None = None) -> torch.Tensor | PartialSums:
    """[rows, hidden] in x's dtype; on CUDA as `PartialSums`, one float32 slice per choice (see
    the module docstring). `path` ("pair", "grouped"; default:
    the pair kernels for a decode step of up to `PAIR_ROWS` rows) picks the CUDA kernels. A
    prefill step always takes the grouped GEMM with one set of tiles, so an eager prefill and the
    piecewise prefill (traced once for every size) compute the same."""
    if not _on_kernels(x):
        return experts_reference(x, gate_up, down, weights, ids)
    decode = gemv.in_decode_step()
    if path is None:
        path = "pair" if decode and x.shape[0] <= PAIR_ROWS else "grouped"
    if path == "pair":
        return pair_experts(x, gate_up, down, weights, ids)
    tiles = grouped_tiles(gate_up.shape[0], down.shape[2], x.shape[1], x.dtype, x.shape[0] if decode else PREFILL_ROWS)
    return grouped_experts(x, gate_up, down, weights, ids, tiles)


def pair_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, tiles: tuple[PairTiles, PairTiles] | None = None) -> PartialSums:
    """The few-row path on CUDA (`tiles`: the two kernels', default `pair_tiles`)."""
    from mmpipe.kernels.moe_kernels import pair_down_kernel, pair_gate_up_kernel

    rows, hidden = x.shape
    top_k, width = ids.shape[1], down.shape[2]
    act = torch.empty(rows * top_k, width, dtype=x.dtype, device=x.device)
    sums = torch.empty(top_k, rows, hidden, dtype=torch.float32, device=x.device)
    if rows:
        up_tiles, down_tiles = tiles or pair_tiles(gate_up.shape[0], width, hidden, x.dtype)
        launch(pair_gate_up_kernel, (rows * top_k, cdiv(width, up_tiles.block_n)), x, gate_up, ids, act, hidden,
               width, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), TOP_K=top_k,
               BLOCK_N=up_tiles.block_n, BLOCK_K=up_tiles.block_k, num_warps=up_tiles.warps)
        launch(pair_down_kernel, (rows * top_k, cdiv(hidden, down_tiles.block_n)), act, down, ids, weights, sums,
               hidden, width, act.stride(0), down.stride(0), down.stride(1), sums.stride(0), sums.stride(1),
               TOP_K=top_k, BLOCK_N=down_tiles.block_n, BLOCK_K=down_tiles.block_k, num_warps=down_tiles.warps)
    return PartialSums(sums, x.dtype)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs (row * top_k + choice) sorted by expert, each expert's run padded to a multiple of
    `block_m` with the sentinel `ids.numel()`: (sorted pairs int32 [most], the expert of every block
    int32 [most / block_m], the padded total int32 [1]). `most` is the worst case of the pair
    count alone, so the shapes never depend on the routing; blocks past the total are not run."""
    flat = ids.reshape(-1).long()
    pairs = flat.shape[0]
    order_experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    first_raw = counts.cumsum(0) - counts
    rank = torch.arange(pairs, device=ids.device) - first_raw[order_experts]
    most = pairs + torch.sym_min(num_experts, pairs) * (block_m - 1)
    sorted_pairs = torch.full((most,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, (ends - padded)[order_experts] + rank, order.to(torch.int32))
    starts = torch.arange(0, most, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:].to(torch.int32)


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, tiles: GroupedTiles) -> PartialSums:
    """The many-row path on CUDA, with these tiles."""
    from mmpipe.kernels.moe_kernels import grouped_down_kernel, grouped_gate_up_kernel

    rows, hidden = x.shape
    num_experts, top_k, width = gate_up.shape[0], ids.shape[1], down.shape[2]
    pairs = rows * top_k
    sorted_pairs, block_expert, total = align(ids, num_experts, tiles.block_m)
    blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    launch(grouped_gate_up_kernel, (blocks, cdiv(width, tiles.up_n)), x, gate_up, sorted_pairs, block_expert, total,
           act, pairs, hidden, width, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), TOP_K=top_k,
           BLOCK_M=tiles.block_m, BLOCK_N=tiles.up_n, BLOCK_K=tiles.up_k, IEEE=ieee, num_warps=tiles.warps,
           num_stages=tiles.stages)
    sums = torch.empty(top_k, rows, hidden, dtype=torch.float32, device=x.device)
    launch(grouped_down_kernel, (blocks, cdiv(hidden, tiles.down_n)), act, down, sorted_pairs, block_expert, total,
           weights, sums, pairs, hidden, width, act.stride(0), down.stride(0), down.stride(1), sums.stride(0),
           sums.stride(1), TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k,
           IEEE=ieee, num_warps=tiles.warps, num_stages=tiles.stages)
    return PartialSums(sums, x.dtype)
