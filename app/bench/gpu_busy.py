"""The GPU's busy share over a stretch of wall time, read from the driver while it runs: NVML's
`utilization.gpu` (the share of the last sample period, a sixth of a second to a second by GPU
model, in which at least one kernel ran), polled on a thread and averaged over the stretch.

Read through `pynvml` when it imports (the nvidia-ml-py package), else `torch.cuda.utilization()`
(which needs it too), else the driver's `libnvidia-ml.so.1` through ctypes; `method` says which,
or why none. Unlike a profiler trace (`app/bench/timeline.py`) it costs the process next to
nothing, but it counts a kernel that fills one SM the same as one that fills them all.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from typing_extensions import Self

POLL_S = 0.05


def _nvml_index(device: int) -> int:
    """NVML's index of CUDA device `device` (CUDA_VISIBLE_DEVICES may renumber)."""
    index_of = getattr(torch.cuda, "_get_nvml_device_index", None)
    try:
        return index_of(device) if index_of is not None else device
    except RuntimeError:
        return device


def _nvml_reader(device: int) -> tuple[Callable[[], float] | None, str]:
    try:
        import pynvml
    except ImportError:
        return None, "pynvml is not installed"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except Exception as exc:  # noqa: BLE001 - NVML's errors are classes of their own per version
        return None, f"NVML failed ({exc})"
    return (lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)), "NVML utilization.gpu (pynvml)"


def _torch_reader(device: int) -> tuple[Callable[[], float] | None, str]:
    try:
        torch.cuda.utilization(device)
    except Exception as exc:  # noqa: BLE001 - no pynvml, no driver: whatever it is, try the next reader
        return None, f"torch.cuda.utilization failed ({type(exc).__name__})"
    return (lambda: float(torch.cuda.utilization(device))), "torch.cuda.utilization (NVML utilization.gpu)"


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


def _ctypes_reader(device: int) -> tuple[Callable[[], float] | None, str]:
    """NVML straight from the driver's library: the device found by its UUID (as CUDA numbers
    it), else by NVML's index."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, "no libnvidia-ml.so.1"
    if nvml.nvmlInit_v2() != 0:
        return None, "nvmlInit failed"
    handle = ctypes.c_void_p()
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except (AssertionError, RuntimeError) as exc:  # no CUDA in this torch, or no such device
        return None, f"CUDA cannot describe device {device} ({exc})"
    uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
    if nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != 0 and \
            nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(_nvml_index(device)), ctypes.byref(handle)) != 0:
        return None, "NVML found no handle for the device"
    rates = _Utilization()

    def read() -> float:
        status = nvml.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(rates))
        if status != 0:
            raise RuntimeError(f"nvmlDeviceGetUtilizationRates returned {status}")
        return float(rates.gpu)

    try:
        read()
    except RuntimeError as exc:
        return None, str(exc)
    return read, "NVML utilization.gpu (libnvidia-ml through ctypes)"


class BusySampler:
    """`with BusySampler() as busy: work()`, then `busy.share` (0 to 1, None when no reading
    could be had), `busy.samples`, `busy.method`."""

    def __init__(self, device: int | None = None) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        self.values: list[float] = []
        self.missed = 0
        self.method = "none"
        self._read: Callable[[], float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        reasons = []
        for pick in (_nvml_reader, _torch_reader, _ctypes_reader):
            self._read, why = pick(self.device)
            if self._read is not None:
                self.method = why
                return
            reasons.append(why)
        self.method = "unavailable: " + "; ".join(reasons)

    def __enter__(self) -> Self:
        self.values, self._stop = [], threading.Event()
        if self._read is not None:
            self._thread = threading.Thread(target=self._poll, name="mmpipe-bench-gpu-busy", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _poll(self) -> None:
        assert self._read is not None
        while not self._stop.is_set():
            try:
                self.values.append(self._read())
            except Exception:  # noqa: BLE001 - a missed reading is one sample fewer, counted
                self.missed += 1
            self._stop.wait(POLL_S)

    @property
    def samples(self) -> int:
        return len(self.values)

    @property
    def share(self) -> float | None:
        return sum(self.values) / len(self.values) / 100 if self.values else None

    def describe(self) -> str:
        if not self.values:
            return self.method
        return f"{self.method}, mean of {len(self.values)} readings polled every {int(POLL_S * 1000)} ms"

