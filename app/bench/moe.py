"""`mmpipe bench moe`: one mixture-of-experts layer of a shape's real widths on the GPU (random
weights, routers with a spread), and the sweep that tunes its kernels.

- Per row count (`--rows`): microseconds per layer (routing and experts) replayed in a CUDA
  graph, run as a decode step runs it (the pair kernels up to `moe.PAIR_ROWS` rows); the bytes of
  the distinct experts the rows chose, and that read's share of the copy bandwidth.
- `--tune`: every candidate tiling timed the same way, the fastest kept per row count
  (`--tune-rows`) and for the pair kernels, written to `mmpipe/kernels/moe_configs.json`, where
  the kernels look them up by (experts, width, hidden, dtype, GPU).
- `--fp8`: the experts in FP8 with 128 x 128 block scales (`Fp8Experts`), as an FP8 checkpoint or
  `quantization="fp8"` holds them; tuned and looked up under their own key.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import SHAPES
from mmpipe.app.bench.timing import copy_bandwidth, graph_us_per_call

from mmpipe.kernels import gemv, moe, moe_configs
from mmpipe.kernels.moe_configs import GroupedTiles, PairTiles
from mmpipe.layers.fp8_experts import Fp8Experts

MOE_SHAPES = sorted(name for name, shape in SHAPES.items() if "num_experts" in shape.text)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=MOE_SHAPES, default="qwen3-vl-30b-a3b", help="default: %(default)s")
    parser.add_argument("--rows", type=int_list, default="1,2,4,8,32,128,512,4096",
                        help="rows per layer call (default %(default)s)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--fp8", action="store_true", help="the experts in FP8 (128x128 block scales)")
    parser.add_argument("--tune", action="store_true", help="sweep the tilings first and keep the fastest")
    parser.add_argument("--tune-rows", type=int_list, default="8,32,128,512,4096",
                        help="row counts the grouped GEMM is tuned at (default %(default)s)")


def layer(experts: int, width: int, hidden: int, dtype: torch.dtype, seed: int = 0, fp8: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, moe.Scales | None]:
    """(gate_up, down, router, the FP8 experts' scales or None)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * width, hidden, device="cuda", generator=g) * 0.02).to(dtype)
    down = (torch.randn(experts, hidden, width, device="cuda", generator=g) * 0.02).to(dtype)
    router = (torch.randn(experts, hidden, device="cuda", generator=g) * 2 / hidden ** 0.5).to(dtype)
    if not fp8:
        return gate_up, down, router, None
    held = Fp8Experts.from_weights(gate_up, down)
    return held.gate_up_proj, held.down_proj, router, held.scales()


def rows_of(count: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(count, hidden, device="cuda", generator=g).to(dtype)


def layer_us(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, router: torch.Tensor, top_k: int,
             experts_fn: Any = None, scales: moe.Scales | None = None) -> float:
    """One layer call in a CUDA graph, as a decode step makes it; `experts_fn(x, gate_up, down,
    weights, ids, scales)` replaces `moe.experts`."""
    run = experts_fn or (lambda *a: moe.experts(*a[:5], scales=a[5]))

    def call() -> None:
        with gemv.allowed(True):
            weights, ids = moe.route(x @ router.T, top_k)
            run(x, gate_up, down, weights, ids, scales)

    return graph_us_per_call([call])


def grouped_candidates(rows: int, fp8: bool = False) -> list[GroupedTiles]:
    """(FP8 experts: 128 columns of K a step, one block of scales.)"""
    blocks_m = (16,) if rows <= 32 else (16, 32) if rows <= 256 else (32, 64)
    ks, stages = ((128,), (3, 4)) if fp8 else ((64, 128), (3,))
    return [GroupedTiles(m, n, k, n, k, warps, stage)
            for m, n, k, warps, stage in itertools.product(blocks_m, (64, 128), ks, (4, 8), stages)]


def pair_candidates() -> tuple[list[PairTiles], list[PairTiles]]:
    """(the gate/up kernel's, the down kernel's): many short programs, or fewer reading more a
    step."""
    ks = (256, 512, 1024)
    ups = [PairTiles(n, k, w) for n, k, w in itertools.product((4, 8, 16), ks, (4, 8))]
    downs = [PairTiles(n, k, w) for n, k, w in itertools.product((4, 8, 16, 32), ks, (4, 8))]
    return ups, downs


def tune(experts: int, width: int, hidden: int, top_k: int, dtype: torch.dtype,
         buckets: tuple[int, ...] = (8, 32, 128, 512, 4096), candidates: int | None = None,
         fp8: bool = False) -> dict[str, Any]:
    """Time the candidates (the first `candidates` of each list, when given), save the fastest:
    the pair kernels at one row, the gate/up kernel's tiles first (the down kernel's default),
    then the down kernel's; the grouped GEMM at each of `buckets` rows."""
    from triton.runtime.errors import OutOfResources

    gate_up, down, router, scales = layer(experts, width, hidden, dtype, fp8=fp8)

    def fastest(options: list[Any], count: int, run: Any) -> Any:
        x = rows_of(count, hidden, dtype)
        timed = []
        for tiles in options[:candidates]:
            try:
                us = layer_us(x, gate_up, down, router, top_k, lambda *a, t=tiles: run(*a, t), scales)
                timed.append((us, tiles))
            except OutOfResources:  # more shared memory or registers than the GPU has: not a candidate
                torch.cuda.synchronize()
        return min(timed, key=lambda pair: pair[0])[1]

    ups, downs = pair_candidates()
    default_down = moe_configs.pair_tiles(experts, width, hidden, dtype, fp8)[1]
    up = fastest(ups, 1, lambda *a: moe.pair_experts(*a[:5], tiles=(a[6], default_down), scales=a[5]))
    pair = (up, fastest(downs, 1, lambda *a: moe.pair_experts(*a[:5], tiles=(up, a[6]), scales=a[5])))
    grouped = {count: fastest(grouped_candidates(count, fp8), count,
                              lambda *a: moe.grouped_experts(*a[:5], a[6], scales=a[5]))
               for count in buckets}
    key = moe_configs.config_key(experts, width, hidden, dtype, torch.cuda.get_device_name(), fp8)
    return moe_configs.save_entry(key, pair, grouped)


def run_moe(args: argparse.Namespace) -> dict[str, Any]:
    text = SHAPES[args.shape].text
    experts, width, hidden, top_k = (text["num_experts"], text["moe_intermediate_size"], text["hidden_size"],
                                     text["num_experts_per_tok"])
    dtype = getattr(torch, args.dtype)
    tuned = tune(experts, width, hidden, top_k, dtype, tuple(args.tune_rows), fp8=args.fp8) if args.tune else None
    gate_up, down, router, scales = layer(experts, width, hidden, dtype, fp8=args.fp8)
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    per_expert += sum(s[0].numel() * s.element_size() for s in scales) if scales else 0
    bandwidth = copy_bandwidth() * 1e9  # bytes per second, read + write counted (as `bench decode`'s floor)
    rows = []
    for count in args.rows:
        x = rows_of(count, hidden, dtype)
        us = layer_us(x, gate_up, down, router, top_k, scales=scales)
        chosen = moe.route(x @ router.T, top_k)[1].unique().numel()
        floor_us = chosen * per_expert / bandwidth * 1e6
        rows.append({"rows": count, "us": round(us, 1), "experts_read": chosen, "floor_us": round(floor_us, 1),
                     "share_of_floor": round(floor_us / us, 3)})
    label = (f"One expert layer, {SHAPES[args.shape].label}: {experts} experts of {width}, {top_k} per row, "
             f"hidden {hidden}, {args.dtype}{', FP8 experts' if args.fp8 else ''}, {torch.cuda.get_device_name()}")
    header = ["rows", "us per layer", "experts read", "read floor us", "floor / time"]
    print(table(label, header, [[r[k] for k in ("rows", "us", "experts_read", "floor_us", "share_of_floor")]
                                for r in rows]))
    return {"device": torch.cuda.get_device_name(), "shape": args.shape, "dtype": args.dtype, "fp8": args.fp8, "rows": rows,
            "tuned": tuned}
