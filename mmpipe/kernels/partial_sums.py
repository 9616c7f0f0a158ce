"""A product left as K-split partial sums, and the residual add + RMSNorm its last program may do.

A few-row product whose matrix has few output columns splits K to keep every SM reading
(`gemv.linear_split`); it returns `PartialSums`, float32 slices that the consumer adds in index
order, so the split costs no extra launch and the result is deterministic.

A one-row split product of an FP8 weight may come *pending* (`defer=True`): not launched until
read. When its reader is the residual add + RMSNorm after it (`fused.add_rms_norm`), that work is
done by the product's last program instead (`PartialSums.add_rms_norm_in_product`): each program
stores its slice and counts its arrival on its stream's counter, and the last to arrive adds the
slices to the residual and norms the row with the norm kernel's code (`rms_norm_row`), then resets
the counter. That saves one kernel per add. Where it measured slower it is not used: rows wider
than `_TAIL_MAX_COLUMNS`, and bfloat16 weights, where only the down projection splits (see
docs/performance.md). `MMPIPE_DISABLE=decode-norm-fusion` keeps the norm kernel; the bits are the
same either way.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from mmpipe import settings
from mmpipe.kernels.launch import next_power_of_2

__all__ = ["NormTail", "PartialSums"]


class PartialSums:
    """A product left as `sums.shape[0]` float32 partial sums over slices of K; its value is their
    sum in index order, rounded to `dtype` (`total()`).

    A one-row FP8 product asked for with `defer=True` comes *pending*: launched when first read
    (`sums`), unless the reader is the residual add + RMSNorm after it (`fused.add_rms_norm`), which
    launches it through `add_rms_norm_in_product` with that add and norm done by the product's last
    program: one kernel fewer per add (see the module docstring). The launch goes to the stream
    current when it is read, with the input as it is then: the model hands the product straight to
    its add."""

    __slots__ = ("_pending", "_sums", "dtype")

    def __init__(self, sums: torch.Tensor, dtype: torch.dtype,
                 pending: Callable[[NormTail | None], None] | None = None) -> None:
        self._sums = sums  # [splits, rows, out_features] float32
        self.dtype = dtype
        self._pending = pending  # launches the product into `_sums` (with the tail, if given)

    @property
    def sums(self) -> torch.Tensor:
        if self._pending is not None:
            self._pending(None)
            self._pending = None  # (after the launch: one that raised leaves it pending, not unwritten)
        return self._sums

    def total(self) -> torch.Tensor:
        acc = self.sums[0]
        for part in self.sums[1:]:  # the order the kernels' consumers add them in
            acc = acc + part
        return acc.to(self.dtype)

    def add_rms_norm_in_product(self, x: torch.Tensor, weight: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + self, rms_norm(x + self) * weight), computed by the last program of the pending
        one-row product to finish, bit for bit as the norm kernel of `fused.add_rms_norm` computes
        them (both lay rows of up to `_TAIL_MAX_COLUMNS` out on 4 warps). None where this does not
        apply (launched already, switched off, wider rows, other shapes, or no counter while a
        graph is being captured): the caller adds `sums` itself."""
        cols = self._sums.shape[-1]
        if (self._pending is None or not settings.current().decode_norm_fused or self._sums.shape[1] != 1
                or x.shape != (1, cols) or x.dtype != self.dtype or not x.is_contiguous()
                or weight.shape != (cols,) or weight.dtype != x.dtype or not weight.is_contiguous()
                or x.device != self._sums.device or weight.device != x.device
                or next_power_of_2(cols) > _TAIL_MAX_COLUMNS):
            return None
        counter = _arrival_counter(x.device)
        if counter is None:
            return None
        residual, normed = torch.empty_like(x), torch.empty_like(x)
        self._pending(NormTail(x, weight, eps, residual, normed, counter))
        self._pending = None
        return residual, normed


class NormTail(NamedTuple):
    """What the last program of a one-row K-split product adds and norms (TAIL of
    `gemv_kernels._row_kernel`)."""

    x: torch.Tensor  # the residual [1, N] the product is added to
    weight: torch.Tensor  # the RMSNorm's [N]
    eps: float
    residual: torch.Tensor  # out: x + product, rounded
    normed: torch.Tensor  # out: rms_norm(residual) * weight
    counter: torch.Tensor  # int32 [1], zero between launches: the programs that have arrived


# The last program holds the row in registers (BLOCK = next power of 2) on the product's 4 warps.
# Up to 2048 columns (the 3B shape) that is the norm kernel's layout, and one-row steps gained;
# at the 7B shape's 3584 columns they measured slower (docs/performance.md), so wider rows keep
# the norm kernel.
_TAIL_MAX_COLUMNS = 2048
_counters: dict[tuple[str, int], torch.Tensor] = {}


def _arrival_counter(device: torch.device) -> torch.Tensor | None:
    """The arrival counter of the one-row tails on the current stream of `device`. Launches on one
    stream run one after another (each counts only after PDL's wait for the kernel before it), so
    one counter serves them all; the last program sets it back to 0. A stream of its own keeps
    tails of two streams from counting on one counter; a captured graph keeps its capture
    stream's (`graphs.capture` uses one per device), so two pipelines' graphs replayed at once on
    one GPU would share it. Made outside graph capture only (a capture's warm-up runs first, on the
    capture stream); None inside one without it."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[key]
