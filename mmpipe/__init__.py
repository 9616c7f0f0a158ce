"""mmpipe: fast, dependable vision-language model inference on NVIDIA GPUs, from Python.

    from mmpipe import Pipeline, SamplingParams
    pipe = Pipeline.from_pretrained()                  # bundled model; or a local checkpoint dir
    print(pipe.caption(["assets/images/scene_0.png"]))

Names are imported lazily so that `vision` and `language` can import `mmpipe.config` and
`mmpipe.runtime` without pulling in the pipeline (and so each other).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "mmpipe.pipeline",
    "SamplingParams": "mmpipe.config",
    "EngineConfig": "mmpipe.config",
    "GraphMode": "mmpipe.config",
    "RequestOutput": "mmpipe.outputs",
    "RequestMetrics": "mmpipe.outputs",
    "MmpipeError": "mmpipe.errors",
    "InputError": "mmpipe.errors",
    "ImageLoadError": "mmpipe.errors",
    "CheckpointError": "mmpipe.errors",
    "UnsupportedModelError": "mmpipe.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmpipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
