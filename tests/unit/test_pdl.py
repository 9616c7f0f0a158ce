"""Programmatic dependent launch (`mmpipe.kernels.pdl`): when it is on, and that a decode-shaped
chain of PDL launches (norm -> product -> partial sums -> norm -> ...) replayed from a CUDA graph
gives the same bits as the same chain launched without PDL, with the few-row products reading
their first weight tile before the wait (the default; `MMPIPE_DISABLE=pdl-prefetch` turns it off)
or after it, for bfloat16 and FP8 weights. A kernel that read anything a predecessor writes before its wait would
read the previous replay's values here: the input changes between replays."""

from __future__ import annotations

import pytest
import torch

from mmpipe.kernels import gemv, gemv_fp8, pdl
from mmpipe.kernels.fused import add_rms_norm, silu_mul

CUDA = torch.cuda.is_available()


def test_off_for_cpu_tensors_and_by_switch(switch) -> None:
    assert not pdl.enabled(torch.zeros(2))
    if CUDA and pdl.HAVE_GDC and torch.cuda.get_device_capability()[0] >= 9:
        x = torch.zeros(2, device="cuda")
        assert pdl.enabled(x)
        switch("pdl", "0")
        assert not pdl.enabled(x)


def _chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], norm_w: torch.Tensor) -> torch.Tensor:
    """Layers of: norm, o-like K-split product, norm adding its partial sums, gate_up, SiLU-fused down.
    A weight is a tensor, or (FP8 weight, per-channel scale)."""
    residual, normed = add_rms_norm(x, None, norm_w, 1e-6)
    for o_w, gate_up_w, down_w in weights:
        residual, normed = add_rms_norm(residual, _split(normed, o_w), norm_w, 1e-6)
        gate_up = gemv.linear(normed, gate_up_w) if isinstance(gate_up_w, torch.Tensor) else gemv_fp8.fp8_linear(
            normed, *gate_up_w)
        if x.shape[0] == 1:
            down = (gemv.gated_linear_split(gate_up, down_w) if isinstance(down_w, torch.Tensor)
                    else gemv_fp8.fp8_gated_linear_split(gate_up, *down_w, defer=True))
        else:
            down = _split(silu_mul(gate_up), down_w)
        residual, normed = add_rms_norm(residual, down, norm_w, 1e-6)
    return normed


def _split(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor]):
    # FP8: deferred as the model asks, so one row's adds run in the product's last program (its tail)
    return (gemv.linear_split(x, weight) if isinstance(weight, torch.Tensor)
            else gemv_fp8.fp8_linear_split(x, *weight, defer=True))


def _weight(rows: int, cols: int, g: torch.Generator, fp8: bool):
    w = torch.randn(rows, cols, device="cuda", generator=g) * cols**-0.5
    if not fp8:
        return w.bfloat16()
    scale = w.abs().amax(dim=1) / 448.0
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale.float().contiguous()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("prefetch", ["1", "0"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.gpu
def test_graph_with_pdl_equals_launches_without(rows: int, prefetch: str, fp8: bool, switch) -> None:
    if not (pdl.HAVE_GDC and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("PDL needs compute capability 9.0 and Triton's griddepcontrol intrinsics")
    switch("pdl-prefetch", prefetch)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 2048, 5632  # K-split partial sums at 1 row (down) and at 8 (o, down)
    weights = [(_weight(hidden, hidden, g, fp8), _weight(2 * inter, hidden, g, fp8), _weight(hidden, inter, g, fp8))
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
    switch("pdl", "0")
    for trial in range(4):
        x.copy_(torch.randn(rows, hidden, device="cuda", generator=g).bfloat16() * (1 + trial))
        graph.replay()
        torch.cuda.synchronize()
        expected = _chain(x, weights, norm_w)  # plain launches, no PDL
        assert torch.equal(out, expected), trial
        assert out.float().abs().sum() > 0
