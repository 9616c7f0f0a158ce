"""Host-to-device copies that never make the host wait for the GPU.

A copy from pageable host memory can hold the host until the stream has run everything queued
before it (the driver stages it through its own pinned buffer), which would undo overlapped
scheduling: the host, meant to prepare step N+1 while the GPU runs step N, would sit out step N.
Staged through pinned memory (PyTorch's caching host allocator, which keeps a block until the
copy that reads it is done), the copy is only queued."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


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


def to_device_packed(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """`arrays` on `device` through one host-to-device copy, as views of it with each array's shape
    and dtype (on the CPU: the arrays themselves as tensors). A step's small inputs are packed
    into one pinned buffer, each at a 16-byte aligned offset (what Triton specialises pointers on,
    so a kernel reading them compiles once whatever the lengths): every copy costs host time
    before the step's first kernel, far more than the bytes it moves."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        if a.dtype not in _TORCH_DTYPES:
            raise TypeError(f"to_device_packed: unsupported dtype {a.dtype}")
        offsets.append(total)
        total += -(-a.nbytes // 16) * 16
    host = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=True)
    flat = host.numpy()
    for a, offset in zip(arrays, offsets):
        flat[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    packed = host.to(device, non_blocking=True)  # the host block is kept until this copy is done
    return [packed[offset:offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, offset in zip(arrays, offsets)]
