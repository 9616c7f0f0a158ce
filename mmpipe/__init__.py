"""mmpipe: fast, dependable vision-language model inference on NVIDIA GPUs, from Python.

    from mmpipe import Pipeline, SamplingParams
    pipe = Pipeline.from_pretrained()                  # bundled model; or a local checkpoint dir
    print(pipe.caption(["assets/images/scene_0.png"]))

Names are imported lazily so that `mmpipe.vision` and `mmpipe.language` can import
`mmpipe.config` and the graphs, kernels and layers without pulling in the pipeline (and so each
other).

In the repository the `vision`, `language` and `app` folders sit beside this package; setuptools
installs them inside it (`package-dir`). Run from a source checkout that is not installed (or from
an editable install whose finder comes after the checkout on the path), a small finder maps the
three names onto those folders, so imports read the same either way.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

_SUBPACKAGES = ("vision", "language", "app")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def _map_source_tree() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    folders = {f"mmpipe.{name}": os.path.join(root, name) for name in _SUBPACKAGES
               if not os.path.isdir(os.path.join(here, name))
               and os.path.isfile(os.path.join(root, name, "__init__.py"))}
    if folders and not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeFinder(folders))


_map_source_tree()

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "mmpipe.pipeline",
    "SamplingParams": "mmpipe.config",
    "EngineConfig": "mmpipe.config",
    "GraphMode": "mmpipe.config",
    "GraphConfig": "mmpipe.config",
    "RequestOutput": "mmpipe.outputs",
    "RequestMetrics": "mmpipe.outputs",
    "MmpipeError": "mmpipe.errors",
    "InputError": "mmpipe.errors",
    "ImageLoadError": "mmpipe.errors",
    "CheckpointError": "mmpipe.errors",
    "UnsupportedModelError": "mmpipe.errors",
    "DeviceMemoryError": "mmpipe.errors",
    "EngineError": "mmpipe.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmpipe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
