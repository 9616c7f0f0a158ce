"""`quantization="fp8"` on the GPU: the one-kernel activation quantizer equals PyTorch's bit for
bit; an FP8 layer equals its arithmetic; every graph mode gives eager's greedy tokens; the bundled
model's held-out scene captions in FP8 against bfloat16 (agreement printed, a floor asserted).
Run with `pytest -m gpu` (needs compute capability 8.9+)."""

from __future__ import annotations

import pytest
import torch
from mmpipe.app.tiny.eval import TEST_SEED_BASE, mmpipe_captions
from mmpipe.app.tiny.scenes import make_scene, score
from torch import nn

from mmpipe import Pipeline, SamplingParams
from mmpipe.kernels.fp8_quant import (
    FP8,
    quantize_per_group,
    quantize_per_group_reference,
    quantize_per_row,
    quantize_per_row_reference,
)
from mmpipe.layers.fp8 import Fp8Linear, _reference_block_product, block_scale_columns
from tests.helpers import random_image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (7, 2048), (33, 5000), (128, 11008), (5, 18944)])
def test_the_quantizer_kernel_equals_pytorch_bit_for_bit(shape, dtype):
    """One pass up to fp8_quant.ONE_PASS_COLUMNS, two for the 7B's 18944 columns."""
    gen = torch.Generator(device="cuda").manual_seed(shape[1])
    x = (torch.randn(shape, device="cuda", generator=gen) *
         torch.logspace(-3, 3, shape[0], device="cuda").unsqueeze(1)).to(dtype)
    x[0, : shape[1] // 2] = 0  # a partly empty row
    if shape[0] > 2:
        x[1] = 0  # an empty row
    values, scale = quantize_per_row(x)
    ref_values, ref_scale = quantize_per_row_reference(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    cpu_values, cpu_scale = quantize_per_row_reference(x.cpu())  # the CPU's arithmetic is the same
    assert torch.equal(cpu_scale.cuda(), scale) and torch.equal(cpu_values.view(torch.uint8).cuda(),
                                                                values.view(torch.uint8))


def test_an_fp8_layer_on_cuda_equals_its_arithmetic():
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(2048, 2560, bias=True).cuda().bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(2560, 2048, generator=gen) * 0.02)
        linear.bias.copy_(torch.randn(2560, generator=gen) * 0.1)
    layer = Fp8Linear.from_linear(linear)
    for rows in (1, 8, 33, 512):
        x = torch.randn(rows, 2048, generator=gen).cuda().bfloat16()
        xq, xs = quantize_per_row_reference(x)
        expected = (xq.float() * xs) @ (layer.weight.float() * layer.weight_scale).t() + linear.bias.float()
        torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2)


def four_image_conversations() -> list:
    """Four conversations of three images of different sizes and prompts of different lengths."""
    images = [random_image(90 + 30 * i, 70 + 20 * i, seed=40 + i) for i in range(3)]
    return [[{"role": "user", "content": [{"type": "image", "image": images[i % 3]},
                                          {"type": "text", "text": "describe it " * (1 + 2 * i)}]}]
            for i in range(4)]


def test_every_graph_mode_gives_eager_tokens_in_fp8(checkpoint):
    conversations = four_image_conversations()
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0)
    tokens = {}
    for mode in ("none", "full_decode_only", "piecewise", "full_and_piecewise"):
        pipe = Pipeline.from_pretrained(checkpoint, device="cuda", dtype="float32", graph_mode=mode,
                                        quantization="fp8", num_kv_pages=512, max_running_requests=4)
        assert "fp8" in pipe.model.quantization and "fp8: 0 " not in pipe.model.quantization
        tokens[mode] = [o.token_ids for o in pipe.chat(conversations, params)]
        pipe.close()
    assert all(t == tokens["none"] for t in tokens.values()), tokens


def test_the_bundled_model_captions_held_out_scenes_in_fp8():
    scenes = [make_scene(s) for s in range(TEST_SEED_BASE, TEST_SEED_BASE + 40)]
    images = [s.image for s in scenes]
    results = {}
    for quantization in (None, "fp8"):
        pipe = Pipeline.from_pretrained(device="cuda", dtype="bfloat16", quantization=quantization, num_kv_pages=4096)
        tokens = mmpipe_captions(pipe, images)
        captions = [pipe.tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
        results[quantization or "bf16"] = (tokens, score(captions, [s.caption for s in scenes]))
        pipe.close()
    same = sum(a == b for a, b in zip(results["bf16"][0], results["fp8"][0]))
    print(f"bundled model, 40 held-out scenes: FP8 tokens equal bfloat16's for {same}/40; "
          f"exact captions bf16 {results['bf16'][1]['exact']:.3f}, fp8 {results['fp8'][1]['exact']:.3f}")
    assert results["fp8"][1]["exact"] >= results["bf16"][1]["exact"] - 0.05


def _fp8_weight(n: int, k: int, seed: int, block: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its scales, the float32 weight it stands for); `block`: 128 x 128 tiles with
    uneven scales (`Fp8Linear`'s layout, columns padded to a multiple of 4)."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n).unsqueeze(1)).cuda()
    if not block:
        values, scale = quantize_per_row_reference(w)
        return values, scale.reshape(-1).contiguous(), values.float() * scale
    grid = (-(-n // 128), -(-k // 128))
    scale = torch.rand(grid, generator=gen).cuda() * 0.01 + 0.001
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    values = (w / full).clamp(-448, 448).to(FP8)
    padded = torch.ones(grid[0], block_scale_columns(k), device="cuda")
    padded[:, :grid[1]] = scale
    return values, padded, values.float() * full


@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 32])
@pytest.mark.parametrize("n,k,bias", [(2560, 2048, True), (2048, 11008, False), (4096, 1024, False)])
def test_few_row_kernels_read_fp8_weights_like_the_dequantized_product(rows, n, k, bias, dtype, scales):
    """Decode's products on FP8 weights (weight-only: activations stay in the model dtype), with
    per-channel or 128 x 128 block scales: the rounded product, its K-split partial sums, and the
    gated down projection."""
    from mmpipe.kernels import gemv_fp8
    from mmpipe.kernels.fused import silu_mul
    from mmpipe.kernels.partial_sums import PartialSums

    weight, scale, dense = _fp8_weight(n, k, seed=rows + n, block=scales == "block")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, k, generator=gen).cuda().to(dtype)
    b = (torch.randn(n, generator=gen).cuda().to(dtype)) if bias else None
    expected = torch.nn.functional.linear(x.float(), dense, None if b is None else b.float())
    # float32: summation order only (K up to 11008, sums of order 10); bfloat16: one rounding of the output
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert gemv_fp8.fp8_usable(x, weight)
    torch.testing.assert_close(gemv_fp8.fp8_linear(x, weight, scale, b).float(), expected, **tol)
    if not bias:
        split = gemv_fp8.fp8_linear_split(x, weight, scale)
        total = split.total() if isinstance(split, PartialSums) else split
        torch.testing.assert_close(total.float(), expected, **tol)
        gate_up = torch.randn(rows, 2 * k, generator=gen).cuda().to(dtype)
        gated = gemv_fp8.fp8_gated_linear_split(gate_up, weight, scale)
        gated = gated.total() if isinstance(gated, PartialSums) else gated
        torch.testing.assert_close(gated.float(), torch.nn.functional.linear(silu_mul(gate_up).float(), dense), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128), (7, 2048), (33, 5000), (300, 11008)])
def test_the_group_quantizer_kernel_equals_pytorch_bit_for_bit(shape, dtype):
    """One scale per row and 128 columns (the last group partial where K is not a multiple)."""
    gen = torch.Generator(device="cuda").manual_seed(shape[1])
    x = (torch.randn(shape, device="cuda", generator=gen) *
         torch.logspace(-3, 3, shape[1], device="cuda").unsqueeze(0)).to(dtype)  # groups of very different range
    values, scale = quantize_per_group(x)
    ref_values, ref_scale = quantize_per_group_reference(x, 128)
    assert scale.shape == ref_scale.shape == (shape[0], -(-shape[1] // 128)) and scale.stride(0) == 1
    assert torch.equal(scale, ref_scale)
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    cpu_values, cpu_scale = quantize_per_group_reference(x.cpu(), 128)  # the CPU's arithmetic is the same
    assert torch.equal(cpu_scale.cuda(), scale) and torch.equal(cpu_values.view(torch.uint8).cuda(),
                                                                values.view(torch.uint8))
    padded_values, padded_scale = quantize_per_group(x, row_multiple=4)  # cuBLASLt's row multiple
    rows = -(-shape[0] // 4) * 4
    assert padded_values.shape[0] == padded_scale.shape[0] == rows and padded_scale.stride(0) == 1
    assert torch.equal(padded_scale[:shape[0]], scale) and torch.equal(padded_values[:shape[0]].view(torch.uint8),
                                                                       values.view(torch.uint8))
    assert not padded_values[shape[0]:].float().any() and bool((padded_scale[shape[0]:] == 1).all())


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("n,k", [(384, 256), (2560, 2048), (2048, 11008)])
def test_a_block_scaled_fp8_layer_on_cuda_equals_its_arithmetic(rows, n, k):
    """cuBLASLt's block-scaled GEMM (1x128 activation groups, 128x128 weight tiles with uneven
    scales) against the same arithmetic in float32; a bias added after."""
    weight, scale, _ = _fp8_weight(n, k, seed=n + k, block=True)
    bias = torch.randn(n, device="cuda").bfloat16()
    layer = Fp8Linear(weight, scale, bias, block=True)
    x = torch.randn(rows, k, device="cuda").bfloat16()
    values, x_scale = quantize_per_group(x)
    expected = _reference_block_product(values, x_scale, weight, layer._full_scale()) + bias.float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().mean().item())


KEEP_TEXT = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from tests.helpers import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("wide")), text=KEEP_TEXT)


@pytest.mark.parametrize("fmt", ["channel", "block"])
def test_an_fp8_checkpoint_runs_in_fp8_in_every_graph_mode(wide, tmp_path, fmt):
    """A published-format FP8 checkpoint keeps its projections in FP8 on the GPU: every graph mode
    gives eager's greedy tokens, and the first-token logits stay within the activation
    quantization's error of the weights dequantized by hand."""
    from tests.helpers import fp8_checkpoint_in_every_graph_mode
    from tests.unit.test_fp8_checkpoints import fp8_pair

    quantized, reference = fp8_pair(wide, tmp_path, fmt, block=(128, 128))
    fp8_checkpoint_in_every_graph_mode(quantized, reference, four_image_conversations(),
                                       "8 language-model linear layers kept in FP8")


def test_fp8_all_quantizes_the_vision_tower_and_keeps_graphs_exact(checkpoint):
    """`fp8-all`: the ViT's linear layers in FP8 too; its image embeddings stay close to bfloat16's
    and every graph mode gives eager's greedy tokens."""
    images = [random_image(90 + 30 * i, 70 + 20 * i, seed=50 + i) for i in range(3)]
    conversations = [[{"role": "user", "content": [{"type": "image", "image": images[i % 3]},
                                                   {"type": "text", "text": "describe it"}]}] for i in range(3)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)
    tokens, embeds = {}, {}
    for quantization, mode in (("fp8", "none"), ("fp8-all", "none"), ("fp8-all", "full_and_piecewise")):
        pipe = Pipeline.from_pretrained(checkpoint, device="cuda", dtype="bfloat16", graph_mode=mode,
                                        quantization=quantization, num_kv_pages=512, max_running_requests=4)
        fp8_vit = sum(isinstance(m, Fp8Linear) for m in pipe.model.vision.modules())
        plain_vit = sum(type(m) is nn.Linear for m in pipe.model.vision.modules())
        if quantization == "fp8-all":
            assert fp8_vit > 0 and plain_vit == 1, (fp8_vit, plain_vit)  # all but the patch embedding
        else:
            assert fp8_vit == 0
        tokens[(quantization, mode)] = [o.token_ids for o in pipe.chat(conversations, params)]
        embeds[(quantization, mode)] = pipe.runner.encode_images([pipe.processor.load_image(i, "probe") for i in images])
        pipe.close()
    assert tokens[("fp8-all", "none")] == tokens[("fp8-all", "full_and_piecewise")]
    from tests.helpers import rel_err

    for a, b in zip(embeds[("fp8-all", "none")], embeds[("fp8", "none")]):
        assert 1e-4 < rel_err(a.float(), b.float()) < 0.1


def _rows_of_magnitudes(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.logspace(-2, 2, rows, device="cuda").unsqueeze(1)  # rows of very different peaks
    return (torch.randn(rows, cols, device="cuda", generator=gen) * scale).to(dtype)


def _same_rows(rows, values: torch.Tensor, scale: torch.Tensor) -> None:
    assert rows.values.dtype == FP8 and rows.scale.shape == scale.shape and rows.scale.stride() == scale.stride()
    assert torch.equal(rows.scale, scale)
    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))


def _quantized(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_group(x, group, row_multiple=4) if group else quantize_per_row(x)


@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("delta", ["none", "tensor", "partial_sums"])
@pytest.mark.parametrize("rows,cols", [(1, 2048), (37, 1280), (300, 2048), (64, 3584), (8, 5120), (5, 1000),
                                       (9, 1536), (33, 2560), (3, 4096), (2, 8192)])
def test_the_norm_writes_fp8_rows_bit_for_bit_as_quantizing_its_output(dtype, delta, rows, cols, group):
    from mmpipe.kernels.fused import add_rms_norm
    from mmpipe.kernels.partial_sums import PartialSums

    x = _rows_of_magnitudes(rows, cols, dtype, rows + cols)
    w = _rows_of_magnitudes(1, cols, dtype, 7)[0] + 1
    d = {"none": None, "tensor": _rows_of_magnitudes(rows, cols, dtype, 3),
         "partial_sums": PartialSums(torch.randn(3, rows, cols, device="cuda"), dtype)}[delta]
    residual, normed = add_rms_norm(x, d, w, 1e-6)
    fused_residual, rows_q = add_rms_norm(x, d, w, 1e-6, fp8=group)
    assert torch.equal(fused_residual, residual)
    _same_rows(rows_q, *_quantized(normed, group))
    assert rows_q.dtype == dtype and rows_q.shape == (rows, cols) and rows_q.group == group


@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 5000), (64, 11008), (130, 3456), (3, 4096), (7, 18944)])
def test_the_silu_product_writes_fp8_rows_bit_for_bit_as_quantizing_its_output(dtype, rows, cols, group):
    """Rows up to fp8_quant.ONE_PASS_COLUMNS in one pass, wider ones (18944, the 7B shape) in two."""
    from mmpipe.kernels.fused import silu_mul

    gate_up = _rows_of_magnitudes(rows, 2 * cols, dtype, rows * cols) * 3
    rows_q = silu_mul(gate_up, fp8=group)
    _same_rows(rows_q, *_quantized(silu_mul(gate_up), group))
    assert rows_q.shape == (rows, cols) and rows_q.dtype == dtype and rows_q.group == group


@pytest.mark.parametrize("quantization,mode", [("fp8", "none"), ("fp8", "full_and_piecewise"),
                                               ("fp8-all", "full_and_piecewise"), ("block checkpoint", "none")])
def test_fused_activation_quantization_changes_no_bit_of_a_run(checkpoint, wide, tmp_path, monkeypatch,
                                                               quantization, mode):
    """(bfloat16) The same requests with the norms and SiLU products quantizing for the FP8 layers
    (the default: `fp8-fused-quant` on) and with each layer quantizing its own input: equal
    tokens, log-probabilities and image embeddings; the eager run shows the fused path was taken
    (per row for `quantization="fp8"`, per 128-column group for a block-scaled FP8 checkpoint)."""
    from mmpipe import settings

    if quantization == "block checkpoint":
        from tests.unit.test_fp8_checkpoints import fp8_pair

        checkpoint, quantization = fp8_pair(wide, tmp_path, "block", block=(128, 128))[0], None

    images = [random_image(200 + 40 * i, 150 + 30 * i, seed=60 + i) for i in range(3)]
    conversations = [[{"role": "user", "content": [{"type": "image", "image": images[i % 3]},
                                                   {"type": "text", "text": "describe it " * (1 + i)}]}]
                     for i in range(4)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0, logprobs=5)
    forward, fed = Fp8Linear.forward, []
    monkeypatch.setattr(Fp8Linear, "forward", lambda self, x, **kw: fed.append(type(x).__name__) or
                        forward(self, x, **kw))
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MMPIPE_DISABLE", "" if flag == "1" else "fp8-fused-quant")
        settings.refresh()
        fed.clear()
        pipe = Pipeline.from_pretrained(checkpoint, device="cuda", dtype="bfloat16", graph_mode=mode,
                                        quantization=quantization, num_kv_pages=512, max_running_requests=4)
        outs = pipe.chat(conversations, params)
        embeds = pipe.runner.encode_images([pipe.processor.load_image(i, "probe") for i in images])
        results[flag] = ([o.token_ids for o in outs], [o.logprobs for o in outs], [e.cpu() for e in embeds])
        pipe.close()
        if mode == "none":
            assert ("Fp8Rows" in fed) == (flag == "1"), sorted(set(fed))
    monkeypatch.delenv("MMPIPE_DISABLE", raising=False)
    settings.refresh()
    assert results["1"][0] == results["0"][0] and results["1"][1] == results["0"][1]
    assert all(torch.equal(a, b) for a, b in zip(results["1"][2], results["0"][2]))


@pytest.mark.parametrize("mode", ["none", "full_decode_only"])
@pytest.mark.parametrize("weights", ["fp8", "block checkpoint"])
def test_fused_activation_quantization_in_decode_batches_above_the_few_row_kernels(wide, tmp_path, monkeypatch,
                                                                                   weights, mode):
    """37 requests decoding together: more rows than the few-row kernels take, so decode's FP8
    products quantize too, fused (per row, or per 128 columns with the rows padded to 4 for
    cuBLASLt) and in the decode graphs with their PDL chain: tokens and log-probabilities equal
    with the switch on and off; the eager run shows fused rows in its decode steps."""
    from mmpipe import settings

    checkpoint, quantization = wide, "fp8"
    if weights == "block checkpoint":
        from tests.unit.test_fp8_checkpoints import fp8_pair

        checkpoint, quantization = fp8_pair(wide, tmp_path, "block", block=(128, 128))[0], None
    prompts = [f"item {i}: " + "tell me more " * (1 + i % 5) for i in range(37)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0, logprobs=3)
    forward, fed = Fp8Linear.forward, []
    monkeypatch.setattr(Fp8Linear, "forward", lambda self, x, **kw: fed.append((type(x).__name__, x.shape[0])) or
                        forward(self, x, **kw))
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MMPIPE_DISABLE", "" if flag == "1" else "fp8-fused-quant")
        settings.refresh()
        pipe = Pipeline.from_pretrained(checkpoint, device="cuda", dtype="bfloat16", graph_mode=mode,
                                        quantization=quantization, num_kv_pages=1024, max_running_requests=40)
        fed.clear()
        outs = pipe.generate(prompts, sampling=params, progress=False)
        results[flag] = ([o.token_ids for o in outs], [o.logprobs for o in outs])
        pipe.close()
        if mode == "none":  # a decode step of all 37 rows fed FP8 rows to the projections, fused on only
            assert (("Fp8Rows", 37) in fed) == (flag == "1"), sorted(set(fed))
    monkeypatch.delenv("MMPIPE_DISABLE", raising=False)
    settings.refresh()
    assert results["1"] == results["0"]


# ---------------------------------------------------------------------------- the Triton FP8 GEMM

@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [33, 64, 100, 256])
@pytest.mark.parametrize("n,k,bias", [(2560, 2048, True), (2048, 11008, False), (200, 384, False)])
def test_the_triton_fp8_gemm_equals_the_dequantized_product(rows, n, k, bias, dtype, scales):
    """Every tile shape and K split `fp8_gemm.rule` uses, on partial row and column tiles, per-channel
    and 128 x 128 block scales (uneven), with a bias: the product of the dequantized operands within
    what Hopper's FP8 tensor cores keep of a 128-product sum (2^-10 of the sum of |products|; the
    kernel adds each such sum to a float32 accumulator), plus one rounding of a bfloat16 output;
    partial sums add up to it."""
    from mmpipe.kernels.fp8_gemm import Config, fp8_gemm
    from mmpipe.kernels.partial_sums import PartialSums

    block = scales == "block"
    weight, scale, dense = _fp8_weight(n, k, seed=rows + n, block=block)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-1, 1, rows).unsqueeze(1)).cuda().to(dtype)
    if block:
        values, x_scale = quantize_per_group(x, 128, 4)  # rows padded to 4, as the layers hand them over
        x_dense = values[:rows].float() * x_scale[:rows].repeat_interleave(128, 1)[:, :k]
    else:
        values, x_scale = quantize_per_row(x)
        x_dense = values.float() * x_scale
    b = torch.randn(n, generator=gen).cuda().to(dtype) if bias else None
    expected = torch.nn.functional.linear(x_dense, dense, None if b is None else b.float())
    bound = 2 ** -10 * (x_dense.abs() @ dense.abs().t()) + 1e-6 * expected.abs().max()
    if dtype == torch.bfloat16:
        bound += 2 ** -8 * expected.abs()
    configs = [Config(64, 64, 128, 4, 4, 1), Config(64, 64, 256, 4, 3, 1), Config(64, 128, 128, 4, 4, 1),
               Config(64, 64, 128, 4, 4, 1, 2), Config(64, 128, 128, 4, 4, 1, 4)]
    for config in configs:
        if (config.split_k > 1 and bias) or (block and config.block_k != 128):
            continue
        out = fp8_gemm(values, x_scale, weight, scale, config, dtype, b, group=128 if block else 0, rows=rows)
        if config.split_k > 1:
            slice_k = -(-(-(-k // config.split_k)) // 128) * 128
            assert isinstance(out, PartialSums) and out.sums.shape[0] == -(-k // slice_k)  # none empty
            out = out.total()
        assert out.shape == (rows, n) and out.dtype == dtype
        excess = ((out.float() - expected).abs() / bound).max().item()
        assert excess <= 1, f"{config}: error up to {excess:.2f} x the bound"


_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                             reason="fp8_gemm.pick chooses the Triton GEMM on Hopper only (where it was swept)")


@_HOPPER
@pytest.mark.parametrize("block", [False, True])
def test_fp8_layers_take_the_triton_gemm_in_decode_steps_only(monkeypatch, block):
    """An FP8 layer multiplies decode rows above the few-row kernels with the Triton GEMM where
    `fp8_gemm.rule` says (K-split partial sums where the caller takes them; block-scaled: those
    only), within bfloat16's rounding of cuBLASLt's product; prefill forwards
    (`gemv.allowed(False)`), > 256 rows, or MMPIPE_DISABLE=fp8-triton-gemm keep cuBLASLt."""
    from mmpipe import settings
    from mmpipe.kernels import fp8_gemm, gemv
    from mmpipe.kernels.partial_sums import PartialSums

    n, k = 2048, 11008
    weight, scale, _ = _fp8_weight(n, k, seed=5, block=block)
    layer = Fp8Linear(weight, scale if block else scale.reshape(-1, 1), None, block=block)
    runs = []
    original = fp8_gemm.fp8_gemm
    monkeypatch.setattr(fp8_gemm, "fp8_gemm", lambda *a, **kw: runs.append(a[4]) or original(*a, **kw))
    x = torch.randn(48, k, device="cuda").bfloat16()

    def product(split=False, rows=48, decode=True):
        runs.clear()
        with gemv.allowed(decode):
            out = layer(x[:rows] if rows <= 48 else torch.randn(rows, k, device="cuda").bfloat16(), split=split)
        return out, [config.split_k for config in runs]

    whole, used = product()
    assert used == ([] if block else [1])
    split_out, used = product(split=True)
    assert isinstance(split_out, PartialSums) and used == [4]
    monkeypatch.setenv("MMPIPE_DISABLE", "fp8-triton-gemm")
    settings.refresh()
    try:
        cublas_out, used = product(split=True)
    finally:
        monkeypatch.delenv("MMPIPE_DISABLE", raising=False)
        settings.refresh()
    assert used == [] and isinstance(cublas_out, torch.Tensor)
    for out in (whole, split_out.total()):
        torch.testing.assert_close(out.float(), cublas_out.float(), rtol=1e-2, atol=1e-2 * cublas_out.abs().max().item())
    assert product(split=True, decode=False)[1] == [] and product(split=True, rows=300)[1] == []
    assert product(split=True, rows=33)[1] == [4] and product(split=True, rows=100)[1] == [4]
    assert (product(split=True, rows=200)[1] == []) == block  # block-scaled: <= 128 rows


@_HOPPER
def test_decode_batches_on_the_triton_fp8_gemm_follow_cublas_and_graphs_replay_them(wide, monkeypatch):
    """40 requests decoding together (bfloat16, `quantization="fp8"`; the graphs pad them to 48
    rows): the decode steps' products run on the Triton GEMM; eager and decode graphs give the same
    tokens and log-probabilities; the first
    decode step's log-probabilities differ from a run on cuBLASLt by far less than FP8 differs from
    bfloat16 (summation order, not quantization; on this small model they may not differ at all)."""
    from mmpipe import settings
    from mmpipe.kernels import fp8_gemm

    prompts = [f"item {i}: " + "tell me more " * (1 + i % 5) for i in range(40)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0, logprobs=3)
    original, calls = fp8_gemm.fp8_gemm, []
    monkeypatch.setattr(fp8_gemm, "fp8_gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or original(*a, **kw))
    results = {}
    for flag, mode, quantization in (("1", "none", "fp8"), ("1", "full_decode_only", "fp8"), ("0", "none", "fp8"),
                                     ("1", "none", None)):
        monkeypatch.setenv("MMPIPE_DISABLE", "" if flag == "1" else "fp8-triton-gemm")
        settings.refresh()
        calls.clear()
        pipe = Pipeline.from_pretrained(wide, device="cuda", dtype="bfloat16", graph_mode=mode,
                                        quantization=quantization, num_kv_pages=1024, max_running_requests=48)
        outs = pipe.generate(prompts, sampling=params, progress=False)
        results[(flag, mode, quantization)] = ([o.token_ids for o in outs], [o.logprobs for o in outs])
        pipe.close()
        if mode == "none" and quantization:
            assert (40 in calls) == (flag == "1"), sorted(set(calls))
    monkeypatch.delenv("MMPIPE_DISABLE", raising=False)
    settings.refresh()
    assert results[("1", "none", "fp8")] == results[("1", "full_decode_only", "fp8")]

    def gap(a, b):  # largest difference of the first decode step's log-probabilities of the same tokens
        return max(abs(x[1][t] - y[1][t]) for x, y in zip(results[a][1], results[b][1]) for t in x[1].keys() & y[1].keys())
    ours_vs_cublas = gap(("1", "none", "fp8"), ("0", "none", "fp8"))
    fp8_vs_bf16 = gap(("0", "none", "fp8"), ("1", "none", None))
    assert fp8_vs_bf16 > 0 and ours_vs_cublas < 0.5 * fp8_vs_bf16, (ours_vs_cublas, fp8_vs_bf16)
