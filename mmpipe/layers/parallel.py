"""The collectives of a tensor-parallel group (`TPGroup`), model-agnostic: the default
`torch.distributed` group, or a standalone backend object (NCCL on GPUs, gloo on the CPU) built on
a store of the group's own, which a process can hold beside another default group. Every
collective is issued on the current stream, so CUDA graphs capture it like any other kernel.

Also the Megatron pieces the language model and the vision tower share: a column-parallel layer
is a plain `nn.Linear` holding some output rows; a row-parallel one a plain `nn.Linear` holding
some input columns, whose owner (attention, MLP) sums its product over the ranks with
`reduce_rows`. Plain layers, so the few-row decode kernels, FP8 quantization and loading treat a
shard like any other layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmpipe.layers.buffers import no_init


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group. `group`: a `torch.distributed` process
    group (None: the default group); `backend`: instead, a standalone backend object
    (`ProcessGroupNCCL` / `ProcessGroupGloo` built on a store of the group's own), attached once
    every rank has joined: a rank's shards are built and loaded before that. `expert_parallel`:
    a mixture of experts' layers are split by whole experts, not along every expert's width."""

    rank: int
    size: int
    group: Any = None
    backend: Any = None
    expert_parallel: bool = False

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

    def read(self, stored: Any) -> torch.Tensor:
        """This rank's part read from a safetensors slice (only that part is read)."""
        return self.padded(stored[self.index(len(stored.get_shape()))])


NOTHING = Slice(0, 0, 0, 0)  # a tensor this rank does not read at all (another rank's expert)


@dataclass(frozen=True)
class ExpertSlice:
    """A rank's part of a mixture of experts' 3D tensor, split along the experts' width: of each
    of `blocks` consecutive blocks of `width` (gate_up: the gate block, then the up block; down:
    one), the columns [start, stop), returned in the layout the model holds (transformers':
    gate_up [experts, 2 * width, hidden], down [experts, hidden, width]). Qwen's files store both
    with the last two dimensions swapped; which layout a stored tensor has is read from its whole
    shape (transformers' where both fit), never from the part's, which may fit both."""

    width: int
    blocks: int
    start: int
    stop: int

    @property
    def held_dim(self) -> int:
        return 1 if self.blocks > 1 else 2

    def _dim(self, shape: Any) -> int:
        full = self.blocks * self.width
        dims = [d for d in (1, 2) if len(shape) == 3 and shape[d] == full]
        if not dims:
            raise ValueError(f"an experts tensor of shape {tuple(shape)} has no dimension of width {full}")
        return self.held_dim if self.held_dim in dims else dims[0]

    def _cut(self, tensor: Any, dim: int) -> torch.Tensor:
        parts = []
        for block in range(self.blocks):
            lo = block * self.width
            parts.append(tensor[(slice(None),) * dim + (slice(lo + self.start, lo + self.stop),)])
        part = torch.cat(parts, dim=dim)
        return part if dim == self.held_dim else part.transpose(1, 2).contiguous()

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._cut(tensor, self._dim(tensor.shape))

    def read(self, stored: Any) -> torch.Tensor:
        return self._cut(stored, self._dim(stored.get_shape()))


def reduce_rows(tp: TPGroup | None, out: Any) -> Any:
    """A row-parallel product summed over the ranks, in place: a tensor, or the few-row kernels'
    `PartialSums` (each float32 slice summed across ranks; the consumer adds the slices, in the
    same order on every rank). `tp` None: unsharded, `out` as it is."""
    if tp is None:
        return out
    from mmpipe.kernels.partial_sums import PartialSums

    if isinstance(out, PartialSums):
        tp.all_reduce(out.sums)
        return out
    return tp.all_reduce(out)


def column_parallel(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A Linear holding the output rows `rows` (an index tensor) of `linear` (weight and bias);
    meta-device layers give their shape only."""
    with no_init():  # every value is copied below (or, on the meta device, loaded later)
        out = nn.Linear(linear.in_features, int(rows.numel()), bias=linear.bias is not None,
                        device=linear.weight.device, dtype=linear.weight.dtype)
    if linear.weight.device.type != "meta":
        index = rows.to(linear.weight.device)
        with torch.no_grad():
            out.weight.copy_(linear.weight[index])
            if linear.bias is not None:
                out.bias.copy_(linear.bias[index])
    return out.requires_grad_(False)


def row_parallel(linear: nn.Linear, start: int, stop: int, tp: TPGroup) -> nn.Linear:
    """A Linear holding the input columns [start, stop) of `linear`; the owner sums its product
    over the ranks (`reduce_rows`). The bias is added once: rank 0 keeps it, the others hold
    zeros."""
    with no_init():
        out = nn.Linear(stop - start, linear.out_features, bias=linear.bias is not None,
                        device=linear.weight.device, dtype=linear.weight.dtype)
    if linear.weight.device.type != "meta":
        with torch.no_grad():
            out.weight.copy_(linear.weight[:, start:stop])
            if linear.bias is not None:
                out.bias.copy_(linear.bias if tp.rank == 0 else torch.zeros_like(linear.bias))
    return out.requires_grad_(False)


def head_rows(first: int, count: int, head_dim: int, offset: int = 0) -> torch.Tensor:
    """Row indices of `count` heads from head `first` in a block of heads starting at row `offset`
    (q, k or v in a fused qkv weight)."""
    return torch.arange(offset + first * head_dim, offset + (first + count) * head_dim)


def shard_gated_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    """A `GatedMLP` (gate and up fused) made rank `tp.rank`'s shard in place: 1/N of the gate and
    of the up rows, the down projection's matching input columns; its product then sums over the
    ranks (`mlp.tp`)."""
    width, n, r = mlp.hidden, tp.size, tp.rank
    if width % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide the MLP width {width}")
    part = width // n
    rows = torch.cat([torch.arange(r * part, (r + 1) * part), width + torch.arange(r * part, (r + 1) * part)])
    mlp.gate_up_proj = column_parallel(mlp.gate_up_proj, rows)
    mlp.down_proj = row_parallel(mlp.down_proj, r * part, (r + 1) * part, tp)
    mlp.hidden, mlp.tp = part, tp
