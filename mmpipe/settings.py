"""Every `MMPIPE_*` environment switch, read in one place and typed.

| variable | field | default | effect |
| --- | --- | --- | --- |
| `MMPIPE_MODEL` | `model` | the bundled model | checkpoint directory used when none is given |
| `MMPIPE_CACHE_DIR` | `cache_dir` | `$XDG_CACHE_HOME/mmpipe`, else `~/.cache/mmpipe` | compile cache root |
| `MMPIPE_GEMV` | `gemv` | on | `0`: decode's few-row products on cuBLAS instead of mmpipe's kernels |
| `MMPIPE_PDL` | `pdl` | on | `0`: no programmatic dependent launch in the decode chain |
| `MMPIPE_PDL_PREFETCH` | `pdl_prefetch` | on | `0`: decode's few-row products wait for the previous kernel before their first weight tile |
| `MMPIPE_DECODE_ROPE_FUSED` | `decode_rope_fused` | on | `0`: decode's rotary + KV write in its own kernel, not inside the attention kernel |
| `MMPIPE_DECODE_NORM_FUSED` | `decode_norm_fused` | on | `0`: a one-row decode step's residual add + RMSNorm in its own kernel, not in the last program of the product before it |
| `MMPIPE_TRITON_DIRECT` | `triton_direct` | on | `0`: every Triton launch through Triton's own path |
| `MMPIPE_PREFILL_PLANS` | `prefill_plans` | on | `0`: every prefill forward through dynamo's guards |
| `MMPIPE_FP8_FUSED_QUANT` | `fp8_fused_quant` | on | `0`: FP8 products quantize their input themselves, not the norm or SiLU kernel before them |
| `MMPIPE_FP8_TRITON_GEMM` | `fp8_triton_gemm` | on | `0`: FP8 products of 33-256 decode rows on cuBLASLt, not mmpipe's Triton FP8 GEMM |
| `MMPIPE_CHECK_GRAPH_INPUTS` | `check_graph_inputs` | off | `1`: replays check their inputs' addresses |
| `MMPIPE_BLOCKING_SYNC` | `blocking_sync` | on | `0`: the engine spins on a core while it waits for a step's tokens, instead of sleeping |

The switches are for debugging and A/B measurements; none changes what is computed, though
`MMPIPE_GEMV` and `MMPIPE_FP8_TRITON_GEMM` choose other kernels for the same products (other
summation orders, so other last bits). They are read once,
at the first `current()`; `refresh()` reads them again (tests, or a process that changes its own
environment). Flags accept `0`/`1`, `false`/`true`, `off`/`on`, `no`/`yes`; anything else is an
error naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from mmpipe.errors import InputError

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Settings:
    model: str | None = None
    cache_dir: Path = Path("~/.cache/mmpipe")
    gemv: bool = True
    pdl: bool = True
    pdl_prefetch: bool = True
    decode_rope_fused: bool = True
    decode_norm_fused: bool = True
    triton_direct: bool = True
    prefill_plans: bool = True
    fp8_fused_quant: bool = True
    fp8_triton_gemm: bool = True
    check_graph_inputs: bool = False
    blocking_sync: bool = True

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "Settings":
        if env.get("MMPIPE_CACHE_DIR"):
            cache_dir = Path(env["MMPIPE_CACHE_DIR"])
        else:
            cache_dir = Path(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "mmpipe"
        return cls(
            model=env.get("MMPIPE_MODEL") or None,
            cache_dir=cache_dir,
            gemv=_flag(env, "MMPIPE_GEMV", True),
            pdl=_flag(env, "MMPIPE_PDL", True),
            pdl_prefetch=_flag(env, "MMPIPE_PDL_PREFETCH", True),
            decode_rope_fused=_flag(env, "MMPIPE_DECODE_ROPE_FUSED", True),
            decode_norm_fused=_flag(env, "MMPIPE_DECODE_NORM_FUSED", True),
            triton_direct=_flag(env, "MMPIPE_TRITON_DIRECT", True),
            prefill_plans=_flag(env, "MMPIPE_PREFILL_PLANS", True),
            fp8_fused_quant=_flag(env, "MMPIPE_FP8_FUSED_QUANT", True),
            fp8_triton_gemm=_flag(env, "MMPIPE_FP8_TRITON_GEMM", True),
            check_graph_inputs=_flag(env, "MMPIPE_CHECK_GRAPH_INPUTS", False),
            blocking_sync=_flag(env, "MMPIPE_BLOCKING_SYNC", True),
        )


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
