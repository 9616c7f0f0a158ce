"""The collectives of a tensor-parallel group (`TPGroup`), model-agnostic: the default
`torch.distributed` group, or a standalone backend object (NCCL on GPUs, gloo on the CPU) built on
a store of the group's own, which a process can hold beside another default group. Every
collective is issued on the current stream, so CUDA graphs capture it like any other kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group. `group`: a `torch.distributed` process
    group (None: the default group); `backend`: instead, a standalone backend object
    (`ProcessGroupNCCL` / `ProcessGroupGloo` built on a store of the group's own), attached once
    every rank has joined: a rank's shards are built and loaded before that."""

    rank: int
    size: int
    group: Any = None
    backend: Any = None

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Sum (or `op`, a `dist.ReduceOp`) over the ranks, in place."""
        if self.size == 1:
            return x
        if self.backend is None:
            dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=self.group)
            return x
        opts = dist.AllreduceOptions()
        opts.reduceOp = op or dist.ReduceOp.SUM
        self.backend.allreduce([x], opts).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s `x` on every rank, in place (contiguous tensors)."""
        if self.size == 1:
            return x
        if self.backend is None:
            dist.broadcast(x, src, group=self.group)
            return x
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.backend.broadcast([x], opts).wait()
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point to point: `x` to rank `dst` (which receives it with `recv`, in the same order)."""
        if self.backend is None:
            dist.send(x, dst, group=self.group)
        else:
            self.backend.send([x], dst, 0).wait()

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Point to point: fill `x` with what rank `src` sends next."""
        if self.backend is None:
            dist.recv(x, src, group=self.group)
        else:
            self.backend.recv([x], src, 0).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        rows, width = flat.shape
        stacked = torch.empty(self.size * rows, width, dtype=x.dtype, device=x.device)  # rank-major
        if self.backend is None:
            dist.all_gather_into_tensor(stacked, flat, group=self.group)
        else:
            self.backend._allgather_base(stacked, flat).wait()
        return stacked.view(self.size, rows, width).transpose(0, 1).reshape(*x.shape[:-1], self.size * width)

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' `value`s (e.g. KV pages: each rank sizes its own cache)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor a rank holds: [start, stop) along `dim`, zero-padded to
    `length` (the last rank of an uneven vocabulary split)."""

    dim: int
    start: int
    stop: int
    length: int

    def index(self, ndim: int) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.stop),) + (slice(None),) * (ndim - self.dim - 1)

    def padded(self, part: torch.Tensor) -> torch.Tensor:
        """`part` (the read [start, stop)) with zero rows up to `length`."""
        missing = self.length - part.shape[self.dim]
        if missing <= 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor."""
        return self.padded(tensor[self.index(tensor.dim())])
