"""Tile sizes of the expert kernels (`moe`), per (experts, width, hidden, dtype, GPU) and row count.

Tuned entries live in `moe_configs.json` beside this module, written by `mmpipe bench moe --tune`
(a sweep on the GPU: every candidate timed inside a CUDA graph, the fastest kept per row count
tried; a step takes the entry of the smallest tried count >= its rows). A shape or GPU without an
entry takes the defaults below: small blocks of rows while few rows reach each expert, larger
ones as the rows grow. FP8 experts (`fp8`) have their own entries and defaults: the grouped
GEMM takes 128 columns of K a step (one block of scales), a pair program's rows divide 128.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, astuple, dataclass
from typing import Any

import torch

__all__ = ["GroupedTiles", "PairTiles", "config_key", "forget_tuned", "grouped_tiles", "pair_tiles", "save_entry",
           "tuned_path"]


@dataclass(frozen=True)
class PairTiles:
    block_n: int
    block_k: int
    warps: int


@dataclass(frozen=True)
class GroupedTiles:
    block_m: int
    up_n: int
    up_k: int
    down_n: int
    down_k: int
    warps: int
    stages: int


def tuned_path() -> str:
    return os.path.join(os.path.dirname(__file__), "moe_configs.json")


@functools.lru_cache(maxsize=1)
def _tuned() -> dict[str, Any]:
    try:
        with open(tuned_path()) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return {}


def config_key(experts: int, width: int, hidden: int, dtype: torch.dtype | str, device: str, fp8: bool = False) -> str:
    """`dtype`: the activations'; `fp8`: the experts' weights are block-scaled FP8."""
    weights = ",weights=fp8" if fp8 else ""
    return f"E={experts},N={width},H={hidden},dtype={str(dtype).removeprefix('torch.')}{weights},device={device}"


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index) if index >= 0 else "cpu"


def _current_device() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


def default_grouped(rows: int, dtype: torch.dtype) -> GroupedTiles:
    """Two stages: the A tile and the gate and up tiles of each stage fit the ~99 KB of shared
    memory the smallest CUDA GPUs give a block (float32 tiles take twice the bytes)."""
    wide = dtype == torch.float32
    if rows <= 64:
        return GroupedTiles(16, 64, 64 if wide else 128, 64, 64 if wide else 128, 4, 2)
    if rows <= 512:
        return GroupedTiles(32, 64, 64, 64, 64, 4, 2)
    return GroupedTiles(64, 128, 32 if wide else 64, 128, 32 if wide else 64, 4 if wide else 8, 2)


def default_fp8_grouped(rows: int, dtype: torch.dtype) -> GroupedTiles:
    """FP8 experts: 128 columns of K a step (one block of scales); the float32 rows of tests
    halve the other tiles for shared memory."""
    wide = dtype == torch.float32
    if rows <= 64:
        return GroupedTiles(16, 64, 128, 64, 128, 4, 2)
    if rows <= 512 or wide:
        return GroupedTiles(32, 64, 128, 64, 128, 4, 2)
    return GroupedTiles(64, 128, 128, 128, 128, 8, 2)


def grouped_tiles(experts: int, width: int, hidden: int, dtype: torch.dtype, rows: int, fp8: bool = False
                  ) -> GroupedTiles:
    """The tuned tiles of the smallest tuned row count >= rows (else the largest tuned), or the defaults."""
    return GroupedTiles(*_grouped_fields(experts, width, hidden, str(dtype).removeprefix("torch."), rows, fp8))


def _grouped_fields(experts: int, width: int, hidden: int, dtype: str, rows: int, fp8: bool) -> tuple[int, ...]:
    return _grouped_lookup(experts, width, hidden, dtype, rows, _current_device(), fp8)


# A traced prefill reads the table once, as a constant: what `torch.compiler.assume_constant_result`
# marks, set here without importing torch._dynamo (seconds of every start-up; test_meta_build.py).
_grouped_fields._dynamo_marked_constant = True  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1024)  # an eager step looks them up in every layer
def _grouped_lookup(experts: int, width: int, hidden: int, dtype: str, rows: int, device: int, fp8: bool
                    ) -> tuple[int, ...]:
    tuned = _tuned().get(config_key(experts, width, hidden, dtype, _device_name(device), fp8), {}).get("grouped", {})
    if not tuned:
        return astuple((default_fp8_grouped if fp8 else default_grouped)(rows, getattr(torch, dtype)))
    counts = sorted(int(b) for b in tuned)
    return astuple(GroupedTiles(**tuned[str(next((b for b in counts if b >= rows), counts[-1]))]))


def pair_tiles(experts: int, width: int, hidden: int, dtype: torch.dtype, fp8: bool = False
               ) -> tuple[PairTiles, PairTiles]:
    """(the gate/up kernel's tiles, the down kernel's)."""
    return _pair_tiles(experts, width, hidden, dtype, _current_device(), fp8)


@functools.lru_cache(maxsize=64)
def _pair_tiles(experts: int, width: int, hidden: int, dtype: torch.dtype, device: int, fp8: bool
                ) -> tuple[PairTiles, PairTiles]:
    entry = _tuned().get(config_key(experts, width, hidden, dtype, _device_name(device), fp8), {})
    if "pair" in entry:
        return PairTiles(**entry["pair"]["up"]), PairTiles(**entry["pair"]["down"])
    return PairTiles(16, 512 if fp8 else 128, 4), PairTiles(8, 512 if fp8 else 128, 4)


def save_entry(key: str, pair: tuple[PairTiles, PairTiles], grouped: dict[int, GroupedTiles]) -> dict[str, Any]:
    """Write one shape's tuned tiles into `tuned_path()` (other entries kept); returns the entry."""
    entry = {"pair": {"up": asdict(pair[0]), "down": asdict(pair[1])},
             "grouped": {str(rows): asdict(t) for rows, t in sorted(grouped.items())}}
    path = tuned_path()
    try:
        with open(path) as handle:
            table = json.load(handle)
    except FileNotFoundError:
        table = {}
    table[key] = entry
    with open(path + ".tmp", "w") as handle:
        json.dump(table, handle, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    forget_tuned()
    return entry


def forget_tuned() -> None:
    """Read `moe_configs.json` again at the next lookup."""
    for cached in (_tuned, _grouped_lookup, _pair_tiles):
        cached.cache_clear()
