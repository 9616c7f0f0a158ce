"""Host-to-device copies that never make the host wait for the GPU.

A copy from pageable host memory can hold the host until the stream has run everything queued
before it (the driver stages it through its own pinned buffer), which would undo overlapped
scheduling: the host, meant to prepare step N+1 while the GPU runs step N, would sit out step N.
Staged through pinned memory (PyTorch's caching host allocator, which keeps a block until the
copy that reads it is done), the copy is only queued."""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` on `device` (on the CPU: the same memory, no copy)."""
    tensor = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def copy_into(target: torch.Tensor, data: np.ndarray | torch.Tensor) -> None:
    """Copy host `data` into the device tensor `target` (same shape), queued without waiting."""
    tensor = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if target.is_cuda and not tensor.is_cuda:
        tensor = tensor.pin_memory()
    target.copy_(tensor, non_blocking=True)
