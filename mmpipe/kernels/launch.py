"""Launching Triton kernels with a few microseconds of host time instead of tens.

`kernel[grid](*args, **constexprs)` costs tens of microseconds of host time per launch in Triton
3.6 (argument binding, specialisation, the cache lookup; `triton.cdiv` and
`triton.next_power_of_2` are JIT "constexpr functions" that cost several microseconds each when
called from host code). That is invisible inside a CUDA graph but not where kernels are launched
eagerly: the attention at every split point of the piecewise prefill (36 per forward on the 3B
shape), eager decode, the ViT outside its graphs.

`launch(kernel, grid, *args, **kwargs)` goes through Triton's own launch the first time for each
*launch key*, keeps the compiled kernel it returns, and afterwards calls that kernel's launcher
directly. The key is strictly finer than Triton's specialisation: every integer argument by value,
every tensor by dtype and 16-byte alignment (what Triton specialises pointers on), the type of
every other argument, the constexprs and launch options, the device. So a direct launch always
runs the binary Triton would have picked. Under `torch.compile` tracing, with Triton's launch hooks
set (profilers), or with `MMPIPE_DISABLE=triton-direct-launch`, every call takes Triton's normal path.

`cdiv` and `next_power_of_2` are the plain host versions of Triton's helpers.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Sequence

import torch

from mmpipe import settings
from mmpipe.kernels import triton

_knobs = importlib.import_module("triton.knobs") if triton is not None else None  # where launch hooks live


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()  # as Triton's: 0 -> 0, 1 -> 1


MAX_ENTRIES = 4096  # integer arguments are keyed by value: bound the cache (it refills as used)


class _Entry:
    __slots__ = ("kernel", "compiled", "tail", "device")

    def __init__(self, kernel: Any, compiled: Any, tail: tuple[Any, ...], device: int) -> None:
        self.kernel = kernel  # the key holds id(kernel): an entry only serves this very object
        self.compiled = compiled
        self.tail = tail  # constexpr values in signature order (Triton's launcher takes them too)
        self.device = device


class DirectLauncher:
    """Per-process cache of compiled kernels by launch key; `launch` is its entry point."""

    def __init__(self) -> None:
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self.enabled: bool | None = None  # None: as `MMPIPE_DISABLE` says (`triton-direct-launch`)
        self.direct_launches = 0
        self.triton_launches = 0
        # Set by `mmpipe.kernels.precompile.compile_in_parallel`: launches from this thread only
        # record their kernel for compilation (Triton's `warmup`) and run nothing.
        self.compile_only_thread: int | None = None
        self.compile_only_submits = 0
        # Launch keys already recorded in this compile-only block: a forward launches each
        # kernel once per layer with the same key, and binding Triton's arguments again for every
        # one cost a noticeable part of a fresh start-up's decode pass (docs/performance.md).
        self.compile_only_seen: set[tuple[Any, ...]] = set()
        # The block's launches with a new key and the device current at each, submitted when it
        # ends (`compile_in_parallel`).
        self.compile_only_pending: list[tuple[Any, tuple[Any, ...], tuple[int, ...], dict[str, Any], int]] = []

    def __call__(self, kernel: Any, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if torch.compiler.is_compiling():  # traced: the tracer records Triton's own launch
            kernel[tuple(grid)](*args, **kwargs)
            return
        if self.compile_only_thread is not None and threading.get_ident() == self.compile_only_thread:
            key = _launch_key(kernel, args, kwargs)  # finer than Triton's specialisation: a seen key
            if key not in self.compile_only_seen:  # needs no second compilation
                self.compile_only_seen.add(key)
                self.compile_only_submits += 1
                self.compile_only_pending.append((kernel, args, tuple(grid), kwargs, torch.cuda.current_device()))
            return
        enabled = self.enabled if self.enabled is not None else settings.current().triton_direct
        if not enabled or _hooks_set():
            self.triton_launches += 1
            kernel[tuple(grid)](*args, **kwargs)
            return
        key = _launch_key(kernel, args, kwargs)
        entry = self.entries.get(key)
        if entry is None or entry.kernel is not kernel:
            self.triton_launches += 1
            compiled = kernel[tuple(grid)](*args, **kwargs)
            device = key[1]
            if compiled is not None and _launchable(compiled) and device >= 0 \
                    and _tail_is_constexpr(kernel, args, kwargs):
                if len(self.entries) >= MAX_ENTRIES:
                    self.entries.clear()
                tail = tuple(kwargs[param.name] for param in kernel.params[len(args):])
                self.entries[key] = _Entry(kernel, compiled, tail, device)
            return
        self.direct_launches += 1
        compiled = entry.compiled
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, _raw_stream(entry.device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *entry.tail)

    def clear(self) -> None:
        self.entries.clear()

    def compiling_only(self) -> bool:
        """Whether launches from this thread only record their kernels (they run nothing); never
        while traced (a traced launch is recorded as it is)."""
        if torch.compiler.is_compiling():
            return False
        return self.compile_only_thread is not None and threading.get_ident() == self.compile_only_thread


def _raw_stream(device: int) -> int:
    """The current CUDA stream of `device` as Triton's launcher takes it (what Triton itself uses)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _device_of(tensor: torch.Tensor) -> int:
    """The device Triton compiles, loads and launches for: the current one. -1 (never cached) off
    CUDA, or when the tensor lives on another device than the current one (Triton's own path then
    behaves as it always does)."""
    index = tensor.get_device()
    return index if index >= 0 and index == torch.cuda.current_device() else -1


def _hooks_set() -> bool:
    """Whether a launch hook is installed (a profiler's): then every launch takes Triton's path,
    which calls the hooks. Triton 3.6 keeps the hooks as chains that are never None, only empty."""
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


def _active(hook: Any) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def _tail_is_constexpr(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Only constexprs, each passed by keyword, may follow the positional arguments: their values
    are part of the key, so the launcher may pass the first call's values again. (A runtime value
    passed by keyword, or a constexpr left to its default, always takes Triton's path.)"""
    params = getattr(kernel, "params", None)
    return params is not None and all(getattr(p, "is_constexpr", False) and p.name in kwargs
                                      for p in params[len(args):])


def _launchable(compiled: Any) -> bool:
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))


def _launch_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A flat tuple: kernel, current device, each argument (tensor: dtype and address mod 16;
    float: the type; anything else: type and value), then the keyword arguments in order, typed."""
    first = args[0] if args else None
    key: list[Any] = [id(kernel), _device_of(first) if isinstance(first, torch.Tensor) else -1]
    for a in args:
        if isinstance(a, torch.Tensor):
            key += (a.dtype, a.data_ptr() & 15)
        elif type(a) is float:
            key.append(float)
        else:
            key += (type(a), a)
    for name, value in kwargs.items():  # typed: True, 1 and 1.0 compile differently
        key += (name, type(value), value)
    return tuple(key)


launch = DirectLauncher()
