"""Programmatic dependent launch (`mmpipe.kernels.pdl`): when it is on, and that a decode-shaped
chain of PDL launches (norm -> product -> partial sums -> norm -> ...) replayed from a CUDA graph
gives the same bits as the same chain launched without PDL."""

from __future__ import annotations

import pytest
import torch

from mmpipe.kernels import gemv, pdl
from mmpipe.kernels.fused import add_rms_norm, silu_mul

CUDA = torch.cuda.is_available()


def test_off_for_cpu_tensors_and_by_switch(switch) -> None:
    assert not pdl.enabled(torch.zeros(2))
    if CUDA and pdl.HAVE_GDC and torch.cuda.get_device_capability()[0] >= 9:
        x = torch.zeros(2, device="cuda")
        assert pdl.enabled(x)
        switch("MMPIPE_PDL", "0")
        assert not pdl.enabled(x)


def _chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], norm_w: torch.Tensor) -> torch.Tensor:
    """Layers of: norm, o-like K-split product, norm adding its partial sums, gate_up, SiLU-fused down."""
    residual, normed = add_rms_norm(x, None, norm_w, 1e-6)
    for o_w, gate_up_w, down_w in weights:
        residual, normed = add_rms_norm(residual, gemv.linear_split(normed, o_w), norm_w, 1e-6)
        gate_up = gemv.linear(normed, gate_up_w)
        if x.shape[0] == 1:
            down = gemv.gated_linear_split(gate_up, down_w)
        else:
            down = gemv.linear_split(silu_mul(gate_up), down_w)
        residual, normed = add_rms_norm(residual, down, norm_w, 1e-6)
    return normed


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.gpu
@pytest.mark.gpu
def test_graph_with_pdl_equals_launches_without(rows: int, switch) -> None:
    if not (pdl.HAVE_GDC and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("PDL needs compute capability 9.0 and Triton's griddepcontrol intrinsics")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 2048, 5632  # K-split partial sums at 1 row (down) and at 8 (o, down)
    weights = [((torch.randn(hidden, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16(),
                (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16(),
                (torch.randn(hidden, inter, device="cuda", generator=g) * inter**-0.5).bfloat16())
               for _ in range(6)]
    norm_w = (torch.rand(hidden, device="cuda", generator=g) + 0.5).bfloat16()
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    assert pdl.enabled(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _chain(x, weights, norm_w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = _chain(x, weights, norm_w)
    switch("MMPIPE_PDL", "0")
    for trial in range(4):
        x.copy_(torch.randn(rows, hidden, device="cuda", generator=g).bfloat16() * (1 + trial))
        graph.replay()
        torch.cuda.synchronize()
        expected = _chain(x, weights, norm_w)  # plain launches, no PDL
        assert torch.equal(out, expected), trial
        assert out.float().abs().sum() > 0
