"""A CUDA graph stand-in for the CPU: `TapeRecorder` records the aten ops a piece runs (with the
tensors they read and wrote) and a replay runs them again on those same tensors, writing each
result into the tensor the recording produced. So, as with a real graph, a replay reads whatever
its recorded inputs hold now: a piece that read a per-step tensor created outside the static
buffers would replay on stale values, and a host sync inside a piece is refused like a capture
refuses it."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_SKIPPED = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
_HOST_SYNC = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


class Tape(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNC:
            raise RuntimeError(f"{func} syncs with the host: it cannot be captured")
        out = func(*args, **kwargs)
        if func not in _SKIPPED:  # views too: `to` is marked a view but copies when the dtype changes
            self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(out), tree_leaves(fresh)):
                if isinstance(old, torch.Tensor) and old is not new and old.data_ptr() != new.data_ptr():
                    old.copy_(new)  # a result in fresh memory lands where the recording's did (views alias already)

    def reset(self) -> None:
        self.ops = []


class TapeRecorder:
    """`split_capture.Recorder` on the CPU."""

    def __init__(self) -> None:
        self.pieces = 0

    def begin(self, memory: Any) -> Tape:
        tape = Tape()
        tape.__enter__()
        return tape

    def end(self, tape: Tape) -> Tape:
        tape.__exit__(None, None, None)
        self.pieces += 1
        return tape

    def abort(self, tape: Tape) -> None:
        tape.__exit__(None, None, None)
        tape.reset()

    def weak(self, value: Any) -> Any:
        return value
