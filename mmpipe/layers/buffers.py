"""Building modules on the meta device cheaply: no weight initialisation (`no_init`), and
computed buffers (rotary frequencies, axis maps) made on the CPU (`on_ambient_device`).

Models are built under `torch.device("meta")` and filled from the checkpoint afterwards; their
computed buffers are rebuilt by `init_buffers` once they have storage. Computing a buffer on the
meta device itself sends `torch.arange` and friends, and `nn.Linear`'s own random
initialisation, through PyTorch's Python reference implementations, whose first use imports
`torch._dynamo`: a noticeable part of every process's start-up, for values that are thrown
away. So buffers are computed on the CPU and placed on the ambient device, and
the initialisers do nothing in a thread while it builds a model (`no_init`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch
from torch import nn

# The initialisers torch.nn's layers call from reset_parameters.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")
_lock = threading.Lock()
_inside = threading.local()  # this thread's no_init depth
_saved: dict[str, Callable[..., torch.Tensor]] = {}  # the real initialisers while any thread builds
_builds = 0


def _skipping(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def init(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if getattr(_inside, "depth", 0):
            return tensor
        return original(tensor, *args, **kwargs)

    return init


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Layers built inside keep their uninitialised storage (for modules whose every parameter
    is loaded afterwards). `torch.nn.init` is one module for the process, so its initialisers
    are replaced while any thread is inside; the replacements skip only in the threads that are,
    so layers another thread builds meanwhile are initialised as usual."""
    global _builds
    with _lock:
        if _builds == 0:
            for name in _INITIALISERS:
                if hasattr(nn.init, name):
                    _saved[name] = getattr(nn.init, name)
                    setattr(nn.init, name, _skipping(_saved[name]))
        _builds += 1
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
        with _lock:
            _builds -= 1
            if _builds == 0:
                for name, fn in _saved.items():
                    setattr(nn.init, name, fn)
                _saved.clear()


def on_ambient_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (computed on the CPU) on the device new tensors go to here (meta under
    `torch.device("meta")`: shape and dtype only)."""
    device = torch.empty(0).device
    return tensor if device == tensor.device else tensor.to(device)
