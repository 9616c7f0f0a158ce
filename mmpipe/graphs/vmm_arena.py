"""A virtual-memory arena for CUDA graphs captured lazily, in any order, that keeps physical memory
at the largest capture instead of the sum.

Physical pages are created with the CUDA driver's VMM API (`cuMemCreate`) and shared by every
capture. Each capture gets a fresh virtual address range (`cuMemAddressReserve`) onto which all
existing pages are mapped (`cuMemMap`, `cuMemSetAccess`); allocation inside it is a bump
pointer from offset 0, and pages are added only when a capture needs more than any before it.
Different addresses keep PyTorch's allocator bookkeeping apart, the same pages keep memory flat.

PyTorch sees the arena through ctypes callbacks given to `torch._C._cuda_customAllocator` and
one `torch.cuda.MemPool` per capture; the caching allocator inside each pool still reuses blocks
within the capture, and asks the arena only for whole segments.

Because all captures alias the same pages, a graph's outputs must be copied out before another
graph of the arena runs, and no graph may keep data in the arena between replays (its inputs live
in static buffers outside it). Traps handled here: the callbacks and the allocator object live for
the whole process (freeing them while a pool exists crashes at garbage collection); graphs must
be destroyed before their pools (`release` order); the primary CUDA context is made current, and
the thread's capture mode relaxed, around driver calls made inside a capture.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

log = logging.getLogger("mmpipe")

_ALIGN = 512
_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _ok(result: Any) -> Any:
    """Unpack a cuda.bindings result tuple, raising on an error code."""
    cu = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class VirtualRange:
    """One capture's address range: every physical chunk mapped at its offset, a bump pointer."""

    base: int
    size: int
    mapped: int = 0  # bytes mapped from offset 0
    offset: int = 0  # bump pointer
    live_segments: int = 0
    released: bool = False
    unmapped: bool = False


@dataclass
class _Chunk:
    offset: int
    size: int
    handle: Any


class VmmArena:
    def __init__(self, device: torch.device, reserve_bytes: int | None = None) -> None:
        cu = _driver()
        self.device = device
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        _ok(cu.cuInit(0))
        dev = _ok(cu.cuDeviceGet(self.ordinal))
        self._context = _ok(cu.cuDevicePrimaryCtxRetain(dev))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.granularity = int(_ok(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
        total = torch.cuda.get_device_properties(device).total_memory
        self.reserve = _round_up(reserve_bytes or total, self.granularity)
        self._chunks: list[_Chunk] = []
        self.physical = 0
        self.ranges: list[VirtualRange] = []
        self._active: VirtualRange | None = None
        self._lock = threading.RLock()
        self.closed = False
        _register(self)

    # ------------------------------------------------------------------ captures

    def open_range(self) -> VirtualRange:
        """A fresh virtual range with every existing page mapped (call before a capture)."""
        cu = _driver()
        with self._lock, self._driver_calls():
            base = int(_ok(cu.cuMemAddressReserve(self.reserve, self.granularity, cu.CUdeviceptr(0), 0)))
            vrange = VirtualRange(base=base, size=self.reserve)
            for chunk in self._chunks:
                self._map(vrange, chunk)
            bisect.insort(self.ranges, vrange, key=lambda r: r.base)  # `free` searches by address
            return vrange

    @contextmanager
    def allocating_in(self, vrange: VirtualRange) -> Iterator[None]:
        """Route segment requests of the allocator callbacks to `vrange`."""
        with self._lock:
            previous, self._active = self._active, vrange
            outer, _capturing.arena = getattr(_capturing, "arena", None), self
        try:
            yield
        finally:
            with self._lock:
                self._active = previous
                _capturing.arena = outer

    def close_range(self, vrange: VirtualRange) -> None:
        """The capture is gone (its graph destroyed, its pool released, the device idle): unmap
        once no segment of it remains."""
        with self._lock:
            vrange.released = True
            if vrange.live_segments == 0:
                with self._driver_calls():
                    self._unmap(vrange)

    # ------------------------------------------------------------------ callbacks

    def alloc(self, size: int) -> int:
        with self._lock:
            vrange = self._active
            if vrange is None or self.closed:
                raise RuntimeError("arena allocation outside a capture range")
            start = _round_up(vrange.offset, _ALIGN)
            end = start + size
            if end > vrange.size:
                raise MemoryError(f"capture needs more than the {vrange.size} bytes reserved")
            if end > vrange.mapped:
                with self._driver_calls():
                    self._grow(vrange, end)
            vrange.offset = end
            vrange.live_segments += 1
            return vrange.base + start

    def free(self, ptr: int) -> bool:
        """Segments are never reused individually: only the range's count drops. Returns whether
        `ptr` belonged to this arena."""
        with self._lock:
            bases = [r.base for r in self.ranges]
            index = bisect.bisect_right(bases, ptr) - 1
            if index < 0 or ptr >= self.ranges[index].base + self.ranges[index].size:
                return False
            vrange = self.ranges[index]
            vrange.live_segments -= 1
            if vrange.released and vrange.live_segments == 0:
                with self._driver_calls():
                    self._unmap(vrange)
            return True

    # ------------------------------------------------------------------ pages

    def _grow(self, vrange: VirtualRange, needed: int) -> None:
        """New physical pages covering up to `needed`, mapped into `vrange`."""
        cu = _driver()
        top = self._chunks[-1].offset + self._chunks[-1].size if self._chunks else 0
        if needed > top:
            size = _round_up(needed - top, self.granularity)
            handle = _ok(cu.cuMemCreate(size, self._prop, 0))
            self._chunks.append(_Chunk(top, size, handle))
            self.physical += size
        for chunk in self._chunks:
            if chunk.offset >= vrange.mapped:
                self._map(vrange, chunk)

    def _map(self, vrange: VirtualRange, chunk: _Chunk) -> None:
        cu = _driver()
        address = cu.CUdeviceptr(vrange.base + chunk.offset)
        _ok(cu.cuMemMap(address, chunk.size, 0, chunk.handle, 0))
        _ok(cu.cuMemSetAccess(address, chunk.size, [self._access], 1))
        vrange.mapped = chunk.offset + chunk.size

    def _unmap(self, vrange: VirtualRange) -> None:
        if vrange.unmapped:
            return
        cu = _driver()
        if vrange.mapped:
            _ok(cu.cuMemUnmap(cu.CUdeviceptr(vrange.base), vrange.mapped))
        _ok(cu.cuMemAddressFree(cu.CUdeviceptr(vrange.base), vrange.size))
        vrange.unmapped = True
        self.ranges.remove(vrange)

    @contextmanager
    def _driver_calls(self) -> Iterator[None]:
        """Primary context current, and this thread's capture mode relaxed (the calls may happen
        while a stream is capturing; none of them is a stream operation)."""
        cu = _driver()
        _ok(cu.cuCtxSetCurrent(self._context))
        previous = _ok(cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        try:
            yield
        finally:
            _ok(cu.cuThreadExchangeStreamCaptureMode(previous))

    def close(self) -> None:
        """Release the pages and every range no allocator still tracks (all graphs must be gone).
        A range with segments PyTorch has not returned yet stays reserved until it does: freeing its
        addresses earlier would let a new range reuse them while PyTorch still knows blocks there.
        Pages stay alive while any range maps them, so releasing the handles now is safe."""
        if self.closed:
            return
        cu = _driver()
        torch.cuda.synchronize(self.device)
        with self._lock, self._driver_calls():
            for vrange in list(self.ranges):
                vrange.released = True
                if vrange.live_segments == 0:
                    self._unmap(vrange)
            for chunk in self._chunks:
                _ok(cu.cuMemRelease(chunk.handle))
            self._chunks.clear()
            self.physical = 0
            self.closed = True


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---------------------------------------------------------------------------- process-wide hooks

_arenas: list[VmmArena] = []
# The arena whose capture is open, per thread: allocations come from the capturing thread, and two
# Pipelines captured from two threads must each reach their own arena.
_capturing = threading.local()
_hooks: dict[str, Any] = {}  # callbacks and allocator: never freed (see the module docstring)


def _register(arena: VmmArena) -> None:
    _arenas.append(arena)


def _alloc_callback(size: int, device: int, stream: int) -> int:
    arena = getattr(_capturing, "arena", None)
    if arena is None:
        log.error("VMM arena: allocation of %d bytes with no capture open", size)
        return 0
    try:
        return arena.alloc(size)
    except Exception as exc:  # an exception must not cross into C++; NULL makes PyTorch raise OOM
        log.error("VMM arena: allocation of %d bytes failed: %s", size, exc)
        return 0


def _free_callback(ptr: int, size: int, device: int, stream: int) -> None:
    try:
        for arena in _arenas:  # closed arenas too: their last ranges wait for these frees
            if arena.free(ptr):
                return
    except Exception as exc:
        log.error("VMM arena: free failed: %s", exc)


def torch_allocator() -> Any:
    """The process-wide PyTorch allocator object backed by the arena callbacks."""
    if "allocator" not in _hooks:
        alloc = _ALLOC_FN(_alloc_callback)
        free = _FREE_FN(_free_callback)
        _hooks["alloc"], _hooks["free"] = alloc, free
        _hooks["allocator"] = torch._C._cuda_customAllocator(ctypes.cast(alloc, ctypes.c_void_p).value,
                                                             ctypes.cast(free, ctypes.c_void_p).value)
    return _hooks["allocator"]


def available() -> bool:
    """Whether the arena can be used here (CUDA, cuda-bindings, the custom-allocator hook)."""
    if not torch.cuda.is_available() or not hasattr(torch._C, "_cuda_customAllocator"):
        return False
    try:
        _driver()
    except ImportError:
        return False
    return hasattr(torch.cuda, "MemPool")
