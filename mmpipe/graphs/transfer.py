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


def pinned(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `data`, copied by numpy: torch's own host copy (`pin_memory`, `cat`,
    `copy_`) fans out to its OpenMP threads past 32768 elements, and they then spin on every core
    for milliseconds after each call. Tensors numpy cannot view (bfloat16) go through torch."""
    if isinstance(data, torch.Tensor):
        if data.dtype not in _NUMPY_VIEWABLE:
            return data.pin_memory()
        data = data.detach().numpy()
    array = np.asarray(data)  # any strides and 0-d kept: numpy's assignment below copies them
    dtype = torch.from_numpy(np.empty(0, array.dtype)).dtype  # not from_numpy(array): read-only ones warn
    host = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    host.numpy()[...] = array
    return host


# torch dtypes whose CPU tensors numpy views without a copy
_NUMPY_VIEWABLE = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
                             torch.float16, torch.float32, torch.float64})


def to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` on `device` (on the CPU: the same memory, no copy)."""
    if device.type != "cuda" or (isinstance(data, torch.Tensor) and data.is_cuda):
        # (to the CPU the copy waits: a non_blocking one could hand back memory not yet written)
        tensor = torch.from_numpy(np.asarray(data, order="C")) if isinstance(data, np.ndarray) else data
        return tensor.to(device, non_blocking=device.type == "cuda")
    return pinned(data).to(device, non_blocking=True)


def copy_into(target: torch.Tensor, data: np.ndarray | torch.Tensor) -> None:
    """Copy host `data` into the device tensor `target` (same shape), queued without waiting."""
    if target.is_cuda and not (isinstance(data, torch.Tensor) and data.is_cuda):
        tensor = pinned(data)
    else:
        tensor = torch.from_numpy(np.asarray(data, order="C")) if isinstance(data, np.ndarray) else data
    target.copy_(tensor, non_blocking=True)


class PackedUploader:
    """A step's small host arrays on the device through one copy, with no per-step allocation.

    Every host call before a step's first kernel is on the critical path of its first token, and
    right after other work each costs several times its price in a tight loop (a tensor operation
    there costs microseconds). So the arrays are written into a pinned host slot at 16-byte
    aligned offsets (what Triton specialises pointers on: a kernel reading them compiles once
    whatever the lengths), the slot's used bytes are copied into one device buffer, and the
    arrays' device views come from one `split` per dtype instead of a slice and casts per array.

    Lifetimes: slots form a ring, and a slot is written again only after the copy that read it
    has finished (an event per slot). The device buffer is reused by the next `upload`, whose
    copy is queued on the same stream, so a step's views stay valid for every kernel queued
    before that copy: the views of one step must not be read by a later one."""

    PAGE = 4096  # copies are rounded up to this, so their views are cached by (slot, size)

    def __init__(self, device: torch.device, slots: int = 4, capacity: int = 1 << 16) -> None:
        self.device, self.num_slots = device, slots
        self.capacity = 0
        self.next = 0
        if device.type == "cuda":
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        # Buffers replaced here are freed through PyTorch's allocators, which hold a block until
        # the copies queued on it are done.
        self.capacity = capacity
        self.host = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(self.num_slots)]
        self.host_typed = [{dt: h.numpy().view(dt) for dt in _TORCH_DTYPES} for h in self.host]
        self.events: list[torch.cuda.Event | None] = [None] * self.num_slots
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.typed = {dt: self.buffer.view(t) for dt, t in _TORCH_DTYPES.items()}
        self.copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """`arrays` on the device as views with their shapes and dtypes (on the CPU: the arrays
        themselves as tensors)."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            if a.dtype not in _TORCH_DTYPES:
                raise TypeError(f"PackedUploader: unsupported dtype {a.dtype}")
            offsets.append(total)
            total += -(-a.nbytes // 16) * 16
        size = max(-(-total // self.PAGE) * self.PAGE, self.PAGE)
        if size > self.capacity:
            self._allocate(1 << (size - 1).bit_length())
        slot = self.next
        self.next = (slot + 1) % self.num_slots
        event = self.events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this slot (long done, normally)
        host = self.host_typed[slot]
        for a, offset in zip(arrays, offsets):
            start = offset // a.itemsize
            host[a.dtype][start:start + a.size].reshape(a.shape)[...] = a
        views = self.copies.get((slot, size))
        if views is None:
            views = self.copies[(slot, size)] = (self.buffer[:size], self.host[slot][:size])
        views[0].copy_(views[1], non_blocking=True)
        if event is None:
            event = self.events[slot] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the stream the copy was queued on
        return self._views(arrays, offsets)

    def _views(self, arrays: Sequence[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
        """One split per dtype over the whole buffer: the arrays' spans, the gaps between them."""
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for dtype, full in self.typed.items():
            members = [i for i, a in enumerate(arrays) if a.dtype == dtype]
            if not members:
                continue
            sizes, cursor = [], 0
            for i in members:
                start = offsets[i] // dtype.itemsize
                sizes += [start - cursor, arrays[i].size]
                cursor = start + arrays[i].size
            sizes.append(full.shape[0] - cursor)
            parts = full.split(sizes)
            for k, i in enumerate(members):
                part = parts[2 * k + 1]
                out[i] = part if arrays[i].ndim == 1 else part.view(arrays[i].shape)
        return out  # type: ignore[return-value]
