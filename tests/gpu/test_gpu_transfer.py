"""`PackedUploader` on CUDA: a step's host arrays through one copy into one device buffer, as
views with their shapes and dtypes; the ring of pinned slots is never rewritten under a copy that
has not run yet, and a step's views hold for every kernel queued before the next upload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpipe.graphs.transfer import PackedUploader, copy_into, pinned, to_device
from tests.helpers import HostKernels

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def step_arrays(seed: int, t: int, b: int) -> list[np.ndarray]:
    """A prefill step's kind of arrays: int64 vectors, a transposed (non-contiguous) int64 matrix,
    an empty one, int32 vectors and a matrix; values differ from step to step."""
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, 10**6, (3, t), dtype=np.int64)
    return [rng.integers(0, 150_000, t, dtype=np.int64), positions.T, rng.integers(0, 10**6, t, dtype=np.int64),
            np.zeros(0, dtype=np.int64), np.array([t], dtype=np.int64), rng.integers(1, 4000, b, dtype=np.int32),
            rng.integers(0, 4000, b + 1, dtype=np.int32), rng.integers(0, 500, (b, 7), dtype=np.int32)]


def same(views: list[torch.Tensor], arrays: list[np.ndarray]) -> bool:
    return all(v.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and tuple(v.shape) == a.shape
               and np.array_equal(v.cpu().numpy(), a) for v, a in zip(views, arrays))


@pytest.mark.parametrize("t,b", [(1, 1), (64, 1), (37, 5), (3000, 40)])
def test_views_have_the_arrays_values_shapes_and_dtypes_at_aligned_addresses(t, b):
    uploader = PackedUploader(CUDA, capacity=4096)  # the larger steps make it grow
    arrays = step_arrays(t, t, b)
    views = uploader.upload(arrays)
    assert same(views, arrays)
    placed = [v for v in views if v.numel()]  # an empty tensor has no address
    assert all(v.data_ptr() % 16 == 0 for v in placed)  # Triton specialises pointers on it
    base = uploader.buffer.data_ptr()
    assert all(base <= v.data_ptr() < base + uploader.capacity for v in placed)  # one buffer, one copy


def test_queued_kernels_read_their_own_step_while_the_ring_turns():
    """Two slots, the GPU held busy: each step's reads are queued behind a sleep, so the host
    writes steps 2 and 3 while step 1's copy has not run. Step 3 reuses step 1's slot and must
    wait for that copy (unless the buffers grew under it); each step's queued reads must see
    that step's values."""
    uploader = PackedUploader(CUDA, slots=2, capacity=4096)
    # steps 3 and 5 outgrow the buffer while earlier copies are still queued; the small steps
    # after them reuse (slot, size) keys of the buffers they replaced
    steps = [step_arrays(seed, t, 3) for seed, t in enumerate([50, 51, 900, 52, 4000, 53, 54])]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # a long sleep on the GPU: every copy below is queued behind it
    read = [[v.clone() for v in uploader.upload(arrays)] for arrays in steps]
    torch.cuda.synchronize()
    assert all(same(r, arrays) for r, arrays in zip(read, steps))


def test_host_copies_are_pinned_by_numpy_and_run_no_torch_host_kernel():
    """torch's own host copy of a big tensor (pin_memory, cat) wakes its OpenMP threads, which
    then spin on every core: the staging copy is numpy's, for arrays and tensors alike."""
    rng = np.random.default_rng(0)
    array = rng.integers(-10**9, 10**9, 300_000, dtype=np.int64)
    tensor = torch.from_numpy(rng.standard_normal((700, 300)).astype(np.float32))
    target = torch.empty(tensor.shape, device=CUDA)
    with HostKernels() as host:
        on_device = [to_device(array, CUDA), to_device(tensor, CUDA), to_device(array[::3], CUDA)]
        copy_into(target, tensor)
    assert host.calls == []
    assert np.array_equal(on_device[0].cpu().numpy(), array) and torch.equal(on_device[1].cpu(), tensor)
    assert np.array_equal(on_device[2].cpu().numpy(), array[::3]) and torch.equal(target.cpu(), tensor)
    assert torch.equal(to_device(tensor.bfloat16(), CUDA).cpu(), tensor.bfloat16())  # numpy has no bfloat16
    staged = [pinned(array[::3]), pinned(tensor.t()), pinned(torch.tensor(5)), pinned(np.zeros((0, 4), np.int32))]
    assert all(s.is_pinned() for s in staged[:3])  # else a non_blocking copy from pageable memory waits
    assert [tuple(s.shape) for s in staged] == [(100_000,), (300, 700), (), (0, 4)]
    assert np.array_equal(staged[0].numpy(), array[::3]) and torch.equal(staged[1], tensor.t())
    assert to_device(torch.tensor(5), CUDA).shape == () and to_device(on_device[1], CUDA) is on_device[1]
