"""Building modules on the meta device cheaply: no weight initialisation (`no_init`), and
computed buffers (rotary frequencies, axis maps) made on the CPU (`on_ambient_device`).

Models are built under `torch.device("meta")` and filled from the checkpoint afterwards; their
computed buffers are rebuilt by `init_buffers` once they have storage. Computing a buffer on the
meta device itself sends `torch.arange` and friends, and `nn.Linear`'s own random
initialisation, through PyTorch's Python reference implementations, whose first use imports
`torch._dynamo`: ~1 s of every process's start-up on a CPU, more on the GPU machines, for values
that are thrown away. So buffers are computed on the CPU and placed on the ambient device, and
the initialisers do nothing while a model is built.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

# The initialisers torch.nn's layers call from reset_parameters.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")
_lock = threading.RLock()  # nested builds keep the no-op initialisers until the outer one ends


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Layers built inside keep their uninitialised storage (for modules whose every parameter
    is loaded afterwards). Process-wide while it lasts, as `torch.nn.init` is a module; one
    build at a time."""
    with _lock:
        saved = {name: getattr(nn.init, name) for name in _INITIALISERS if hasattr(nn.init, name)}
        try:
            for name in saved:
                setattr(nn.init, name, _keep)
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def on_ambient_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (computed on the CPU) on the device new tensors go to here (meta under
    `torch.device("meta")`: shape and dtype only)."""
    device = torch.empty(0).device
    return tensor if device == tensor.device else tensor.to(device)
