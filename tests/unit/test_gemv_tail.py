"""The one-row K-split product whose last program adds its partial sums to the residual and norms
the sum (`partial_sums.PartialSums.add_rms_norm_in_product`), under the Triton interpreter (in a
subprocess: TRITON_INTERPRET is read when a kernel is defined). The interpreter runs the programs
one after another in grid order, so a tail that fired before the last arrival would read a slice
never written: this catches the arrival count, which a GPU's near-simultaneous arrivals may hide.
Against the norm kernel on the same partial sums: the same bits; the counter back at zero.
On CUDA (FP8 weights, graphs, repeated launches): tests/unit/test_gemv.py.
"""

from __future__ import annotations

from tests.helpers import run_under_triton_interpreter

_SCRIPT = """
import json
import torch
from mmpipe.kernels import fused, gemv_kernels, partial_sums
from mmpipe.kernels.launch import launch
print("READY")
cases = []
for n, k, gated in ((40, 8192, True), (96, 8192, False)):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g)
    w = torch.randn(n, k // 2 if gated else k, generator=g) / 16
    residual = torch.randn(1, n, generator=g) * 4
    norm_w = torch.rand(n, generator=g) + 0.5
    splits = gemv_kernels.k_splits(1, n, w.shape[1])
    for _ in range(2):  # the second launch starts from the counter the first left
        sums = torch.full((splits, 1, n), float("nan"))  # a slice read before it is written shows
        pending = partial_sums.PartialSums(sums, x.dtype,
                                           lambda tail: gemv_kernels.run(x, w, None, sums, splits, gated, None, tail))
        got = pending.add_rms_norm_in_product(residual, norm_w, 1e-6)
        res, out = torch.empty_like(residual), torch.empty_like(residual)
        launch(fused._add_rms_norm_kernel, (1,), residual, sums, norm_w, res, out, residual, n,
               residual.stride(0), sums.stride(1), sums.stride(0), 0, 1e-6, 1e-12, 448.0, 1 / 448.0,
               HAS_DELTA=True, SPLITS=splits, QUANT=0, GROUP=1, BLOCK=1 << (n - 1).bit_length(), PDL=False,
               num_warps=4)
        same = got is not None and torch.equal(got[0], res) and torch.equal(got[1], out)
        cases.append([n, k, gated, splits, same and not torch.isnan(got[1]).any().item(),
                      int(partial_sums._counters["cpu", 0].item())])
print("RESULTS " + json.dumps(cases))
"""


def test_last_program_adds_and_norms_after_every_slice_under_interpreter():
    cases = run_under_triton_interpreter(_SCRIPT)
    assert len(cases) == 4 and all(splits > 1 for _, _, _, splits, _, _ in cases)
    assert all(ok and counter == 0 for *_, ok, counter in cases), cases
