"""`quantization="fp8"`: weights quantized at load (per output channel), activations per token,
products through `torch._scaled_mm` (which the CPU build also runs, so the arithmetic is checked
here; the GPU tests check cuBLASLt's). Refused clearly where it cannot run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmpipe import Pipeline
from mmpipe.errors import InputError
from mmpipe.layers.fp8 import FP8, FP8_MAX, Fp8Linear, Fp8Rows, quantize_linears, quantize_per_row
from mmpipe.quantization import LM_FP8_LAYERS, check_runtime_quantization
from tests.lm_helpers import tiny_lm


def test_the_quantizer_round_trips_within_fp8_error_and_scales_each_row_to_its_own_maximum():
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes: one shared scale would flush the small rows to zero.
    x = torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 1e-1, 1.0, 10.0, 1e3, 0.0]).unsqueeze(1)
    values, scale = quantize_per_row(x)
    assert values.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    back = values.float() * scale
    peak = x.abs().amax(dim=1, keepdim=True)
    assert torch.all(values.float().abs().amax(dim=1)[:5] == FP8_MAX)  # each row's largest hits 448
    # E4M3 keeps 3 mantissa bits: relative error at most 2^-4 of the value (plus the subnormal floor).
    assert torch.all((back - x).abs() <= x.abs() / 16 + peak * 2.0**-9 + 1e-30)
    assert torch.all(back[5] == 0)  # an all-zero row stays zero, with a finite scale
    assert torch.isfinite(scale).all()


def test_an_fp8_linear_equals_its_arithmetic_and_applies_scales_per_output_channel():
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 32, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 64, generator=gen) * torch.logspace(-2, 2, 32).unsqueeze(1))
        linear.bias.copy_(torch.randn(32, generator=gen))
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 5, 64, generator=gen) * torch.logspace(-1, 1, 5).view(1, 5, 1)
    xq, xs = quantize_per_row(x.reshape(-1, 64))
    expected = (xq.float() * xs) @ (layer.weight.float() * layer.weight_scale).t() + linear.bias
    out = layer(x)
    assert out.shape == (2, 5, 32)
    torch.testing.assert_close(out.reshape(-1, 32), expected, rtol=1e-5, atol=1e-5)
    # Close to the unquantized layer (each operand within E4M3's error).
    reference = linear(x)
    assert ((out - reference).norm() / reference.norm()).item() < 0.05
    torch.testing.assert_close(layer.dequantized_weight(), linear.weight, rtol=1 / 16, atol=1e-6)


class Emulated(Fp8Linear):
    """An Fp8Linear's arithmetic in plain float32 ops: activations quantized and dequantized per
    token, times the dequantized weight (a subclass, so the model calls it where it calls FP8)."""

    def __init__(self, layer: Fp8Linear) -> None:
        super().__init__(layer.weight, layer.weight_scale, layer.bias)

    def forward(self, x, split=False):  # (a product the caller may take as partial sums: here whole)
        if isinstance(x, Fp8Rows):  # quantized by the kernel before (the norm or the SiLU product)
            values, scale, shape = x.values, x.scale, x.shape
        else:
            values, scale = quantize_per_row(x.reshape(-1, x.shape[-1]))
            shape = x.shape
        return nn.functional.linear((values.float() * scale).reshape(shape), self.dequantized_weight(), self.bias)


def test_every_language_model_projection_is_quantized_and_runs_its_arithmetic():
    """All four projections of every layer become FP8 (the head does not); the model's forward
    equals the same arithmetic written out in float32 ops, and stays near the unquantized model."""
    from tests.lm_helpers import make_runner, run

    lm, reference, emulated = tiny_lm(), tiny_lm(), tiny_lm()
    count = quantize_linears(lm, LM_FP8_LAYERS)
    assert count == 4 * lm.cfg.num_layers
    for layer, twin in zip(lm.layers, emulated.layers):
        for owner, other, names in ((layer.self_attn, twin.self_attn, ("qkv_proj", "o_proj")),
                                    (layer.mlp, twin.mlp, ("gate_up_proj", "down_proj"))):
            for name in names:
                assert isinstance(getattr(owner, name), Fp8Linear), name
                setattr(other, name, Emulated(getattr(owner, name)))
    assert lm.lm_head is None or isinstance(lm.lm_head, nn.Linear)  # the head stays in the run's dtype
    a, b, c = (run(make_runner(m, piecewise=False), [(0, 12)], seed=3) for m in (reference, lm, emulated))
    torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-4)
    assert 0 < ((b - a).norm() / a.norm()).item() < 0.25  # random weights, two layers of FP8 error


def test_fp8_is_refused_by_name_where_it_cannot_run(checkpoint):
    with pytest.raises(InputError, match="needs a GPU with FP8 tensor cores .* this run's device is cpu"):
        Pipeline.from_pretrained(checkpoint, device="cpu", quantization="fp8")
    with pytest.raises(InputError, match="quantization='fp8-all' needs a GPU with FP8 tensor cores"):
        check_runtime_quantization("fp8-all", torch.device("cpu"))
    with pytest.raises(InputError, match="quantization='int4': use 'fp8' .*, 'fp8-all' .* or None"):
        Pipeline.from_pretrained(checkpoint, device="cpu", quantization="int4")
    assert check_runtime_quantization(None, torch.device("cpu")) is None
    assert check_runtime_quantization("none", torch.device("cpu")) is None


def block_scaled(linear: nn.Linear, seed: int) -> Fp8Linear:
    """`linear` as a block-scaled FP8 layer with uneven 128 x 128 tile scales."""
    from mmpipe.layers.fp8 import BLOCK, block_scale_columns

    n, k = linear.weight.shape
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(-(-n // BLOCK), block_scale_columns(k), generator=gen) * 0.01 + 0.002
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    weight = (linear.weight.detach() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Linear(weight, scale, linear.bias.detach() if linear.bias is not None else None, block=True)


@pytest.mark.parametrize("scales", ["channel", "block"])
def test_norms_and_silu_products_hand_fp8_layers_their_input_quantized_with_the_same_bits(monkeypatch, scales):
    """With FP8 projections the RMSNorm before qkv and gate_up and the SiLU product before down
    quantize their output themselves (`Fp8Rows`: per row for per-channel layers, per 128-column
    group for block-scaled ones); the model's output is bit for bit the one of each projection
    quantizing its own input (MMPIPE_DISABLE=fp8-fused-quant). o_proj reads attention's output and
    quantizes it itself."""
    from mmpipe import settings
    from tests.lm_helpers import make_runner, run

    lm = tiny_lm()
    if scales == "channel":
        quantize_linears(lm, LM_FP8_LAYERS)
    else:
        for index, (parent, name) in enumerate((p, n) for p in lm.modules() for n, c in p.named_children()
                                               if n in LM_FP8_LAYERS and isinstance(c, nn.Linear)):
            setattr(parent, name, block_scaled(getattr(parent, name), index))
    seen: dict[str, list[bool]] = {}
    forward = Fp8Linear.forward

    def spy(self, x, **kw):
        seen.setdefault(self.name, []).append(isinstance(x, Fp8Rows) and x.group == (128 if self.block else 0))
        return forward(self, x, **kw)

    for module_name, module in lm.named_modules():
        if isinstance(module, Fp8Linear):
            module.name = module_name.rsplit(".", 1)[-1]
    monkeypatch.setattr(Fp8Linear, "forward", spy)
    outputs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MMPIPE_DISABLE", "" if flag == "1" else "fp8-fused-quant")
        settings.refresh()
        seen.clear()
        outputs[flag] = run(make_runner(lm, piecewise=False), [(0, 12), (0, 5)], seed=3)
        layers = lm.cfg.num_layers
        fused = {name: sum(flags) for name, flags in seen.items()}
        if flag == "1":
            assert fused == {"qkv_proj": layers, "o_proj": 0, "gate_up_proj": layers, "down_proj": layers}, fused
        else:
            assert not any(fused.values()), fused
    monkeypatch.delenv("MMPIPE_DISABLE", raising=False)
    settings.refresh()
    assert torch.equal(outputs["1"], outputs["0"])


def test_fp8_rows_go_only_to_a_layer_of_their_width_and_scaling():
    from mmpipe.kernels.fp8_quant import rows_of

    layer = Fp8Linear.from_linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(rows_of(x)), layer(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="width 48 given to in_features=64"):
        layer(rows_of(torch.randn(3, 48)))
    with pytest.raises(ValueError, match="quantized per 128 columns with width 64 given to .*per-channel"):
        layer(rows_of(x, 128))  # group scales to a per-channel layer
    block = block_scaled(nn.Linear(64, 32, bias=False), seed=1)
    with pytest.raises(ValueError, match="quantized per row with width 64 given to .*block scales"):
        block(rows_of(x))
    torch.testing.assert_close(block(rows_of(x, 128, row_multiple=4)), block(x), rtol=0, atol=0)  # padded rows cut


def test_the_fused_kernels_refuse_a_group_width_they_cannot_tile():
    from mmpipe.kernels.fused import add_rms_norm, silu_mul

    with pytest.raises(ValueError, match="fp8=96: give None, 0 .* or a power-of-two group width"):
        add_rms_norm(torch.randn(2, 192), None, torch.ones(192), 1e-6, fp8=96)
    with pytest.raises(ValueError, match="fp8=96"):
        silu_mul(torch.randn(2, 384), fp8=96)


def test_runtime_quantization_frees_each_linear_before_the_next(monkeypatch):
    """When a layer is quantized, no earlier layer's unquantized weight is still held (the peak is
    the unquantized model plus one layer)."""
    import weakref

    lm = tiny_lm()
    plain = [weakref.ref(m.weight) for m in lm.modules() if isinstance(m, nn.Linear)]
    alive_at_each_call = []
    original = Fp8Linear.from_linear.__func__

    def spy(cls, linear):
        alive_at_each_call.append(sum(ref() is not None for ref in plain))
        return original(cls, linear)

    monkeypatch.setattr(Fp8Linear, "from_linear", classmethod(spy))
    count = quantize_linears(lm, LM_FP8_LAYERS)
    assert alive_at_each_call == [len(plain) - k for k in range(count)]
