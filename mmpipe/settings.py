"""Every environment variable mmpipe reads, in one place and typed.

| variable | default | effect |
| --- | --- | --- |
| `MMPIPE_MODEL` | the bundled model | checkpoint directory used when none is given |
| `MMPIPE_CACHE_DIR` | `$XDG_CACHE_HOME/mmpipe`, else `~/.cache/mmpipe` | compile cache root |
| `MMPIPE_DISABLE` | nothing | comma-separated optimisations to turn off (the names below), for debugging and A/B measurements |
| `MMPIPE_CHECK_GRAPH_INPUTS` | `0` | `1`: every prefill-graph replay checks its inputs' addresses against the capture's |
| `MMPIPE_CAPTION_SHARD_STATUS` | unset | set by `mmpipe caption --gpus N` for its processes: the folder where each marks its shard done |

The names `MMPIPE_DISABLE` takes (`docs/configuration.md` says more of each). None changes what
is computed, except that `gemv`, `fp8-triton-gemm` and `extend-decode-rows` run the same products
on other kernels (another summation order, so other last bits):

| name | turns off |
| --- | --- |
| `gemv` | decode's few-row products on mmpipe's kernels (cuBLAS instead) |
| `pdl` | programmatic dependent launch in the decode chain |
| `pdl-prefetch` | few-row products loading their first weight tile before waiting for the kernel before them |
| `decode-rope-fusion` | decode's rotary + KV write inside the attention kernel (its own kernel instead) |
| `decode-norm-fusion` | a one-row decode step's residual add + RMSNorm in the last program of the product before it |
| `triton-direct-launch` | Triton launches through mmpipe's cached launcher (Triton's own path instead) |
| `prefill-plans` | prefill replay plans (every traced prefill forward through dynamo's guards) |
| `fp8-fused-quant` | norm and SiLU kernels writing the FP8 input of the product after them |
| `fp8-triton-gemm` | mmpipe's Triton FP8 GEMM for 33-256 decode rows (cuBLASLt instead) |
| `blocking-sync` | the engine sleeping between short looks while it waits for a step's tokens (it spins on a core instead) |
| `extend-decode-rows` | an extend step of a few tokens per sequence over long contexts run as rows through the split-KV rows kernel, and in one graph where the step fits (the extend kernel between the prefill pieces instead) |

The variables are read once, at the first `current()`; `refresh()` reads them again (tests, or a
process that changes its own environment). An unknown name in `MMPIPE_DISABLE`, a flag other than
`0`/`1`/`false`/`true`/`off`/`on`/`no`/`yes`, or a retired per-switch variable (`MMPIPE_PDL`, ...)
is an error naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from mmpipe.errors import InputError

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")

# `MMPIPE_DISABLE` name -> the `Settings` field it turns off.
DISABLE_NAMES = {
    "gemv": "gemv",
    "pdl": "pdl",
    "pdl-prefetch": "pdl_prefetch",
    "decode-rope-fusion": "decode_rope_fused",
    "decode-norm-fusion": "decode_norm_fused",
    "triton-direct-launch": "triton_direct",
    "prefill-plans": "prefill_plans",
    "fp8-fused-quant": "fp8_fused_quant",
    "fp8-triton-gemm": "fp8_triton_gemm",
    "blocking-sync": "blocking_sync",
    "extend-decode-rows": "extend_decode_rows",
}
# Variables of earlier releases, one per switch: set, they would silently do nothing.
_RETIRED = {"MMPIPE_GEMV": "gemv", "MMPIPE_PDL": "pdl", "MMPIPE_PDL_PREFETCH": "pdl-prefetch",
            "MMPIPE_DECODE_ROPE_FUSED": "decode-rope-fusion", "MMPIPE_DECODE_NORM_FUSED": "decode-norm-fusion",
            "MMPIPE_TRITON_DIRECT": "triton-direct-launch", "MMPIPE_PREFILL_PLANS": "prefill-plans",
            "MMPIPE_FP8_FUSED_QUANT": "fp8-fused-quant", "MMPIPE_FP8_TRITON_GEMM": "fp8-triton-gemm",
            "MMPIPE_BLOCKING_SYNC": "blocking-sync"}


@dataclass(frozen=True)
class Settings:
    model: str | None = None
    cache_dir: Path = Path("~/.cache/mmpipe")
    check_graph_inputs: bool = False
    caption_shard_status: str | None = None
    # On unless named in MMPIPE_DISABLE.
    gemv: bool = True
    pdl: bool = True
    pdl_prefetch: bool = True
    decode_rope_fused: bool = True
    decode_norm_fused: bool = True
    triton_direct: bool = True
    prefill_plans: bool = True
    fp8_fused_quant: bool = True
    fp8_triton_gemm: bool = True
    blocking_sync: bool = True
    extend_decode_rows: bool = True

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "Settings":
        for variable, name in _RETIRED.items():
            if variable in env:
                raise InputError(f"{variable} is no longer read: use MMPIPE_DISABLE={name} to turn that off")
        if env.get("MMPIPE_CACHE_DIR"):
            cache_dir = Path(env["MMPIPE_CACHE_DIR"])
        else:
            cache_dir = Path(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "mmpipe"
        return cls(model=env.get("MMPIPE_MODEL") or None, cache_dir=cache_dir,
                   check_graph_inputs=_flag(env, "MMPIPE_CHECK_GRAPH_INPUTS", False),
                   caption_shard_status=env.get("MMPIPE_CAPTION_SHARD_STATUS") or None,
                   **{field: False for field in _disabled(env.get("MMPIPE_DISABLE", ""))})


def _disabled(raw: str) -> list[str]:
    """The `Settings` fields that `MMPIPE_DISABLE` turns off."""
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in DISABLE_NAMES]
    if unknown:
        raise InputError(f"MMPIPE_DISABLE={raw!r}: unknown name(s) {', '.join(unknown)}; known: "
                         f"{', '.join(DISABLE_NAMES)}")
    return [DISABLE_NAMES[name] for name in names]


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InputError(f"{name}={raw!r}: use 1 or 0")


def variables() -> list[str]:
    """The environment variables mmpipe reads (the module's first table)."""
    return [line.split("`")[1] for line in (__doc__ or "").split("\n\n")[1].splitlines() if line.startswith("| `")]


_current: Settings | None = None


def current() -> Settings:
    """The switches as read from the environment (once; `refresh()` reads them again)."""
    global _current
    if _current is None:
        _current = Settings.from_environ(os.environ)
    return _current


def refresh() -> Settings:
    """Read the environment again, e.g. after a test changed a variable."""
    global _current
    _current = None
    return current()
