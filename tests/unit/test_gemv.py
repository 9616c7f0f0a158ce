"""The few-row matmul kernels (`mmpipe.kernels.gemv`) and the K-split partial sums that
`add_rms_norm` adds up. CPU: the fallbacks and the partial-sum arithmetic. GPU: the kernels
against cuBLAS and a float64 reference, padding invariance, the split's consumer."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mmpipe.kernels import gemv, gemv_fp8, gemv_kernels, partial_sums
from mmpipe.kernels.fused import add_rms_norm, rms_norm_reference
from mmpipe.kernels.partial_sums import PartialSums

# ------------------------------------------------------------------------------------------- CPU


def test_cpu_tensors_take_f_linear() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g) for s in ((3, 24), (40, 24), (40,)))
    assert not gemv.usable(x, w)
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(gemv.linear(x, w, out_dtype=torch.float64), F.linear(x, w).double())
    assert torch.equal(gemv.linear_split(x, w), F.linear(x, w))


def test_partial_sums_add_in_order_and_round_once() -> None:
    g = torch.Generator().manual_seed(1)
    sums = torch.randn(4, 3, 64, generator=g) * torch.tensor([1e4, 1.0, -1e4, 1e-3]).view(4, 1, 1)
    total = PartialSums(sums, torch.bfloat16).total()
    expected = (((sums[0] + sums[1]) + sums[2]) + sums[3]).to(torch.bfloat16)
    assert total.dtype == torch.bfloat16 and torch.equal(total, expected)
    # float32 addition is not associative: in index order 1e8 + 1 - 1e8 + 1 is 1, in reverse 0
    cancel = torch.tensor([1e8, 1.0, -1e8, 1.0]).view(4, 1, 1).expand(4, 2, 8).contiguous()
    assert torch.equal(PartialSums(cancel, torch.float32).total(), torch.ones(2, 8))


def test_add_rms_norm_adds_partial_sums_like_their_total() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    parts = PartialSums(torch.randn(2, 3, 64, generator=g), torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    residual, normed = add_rms_norm(x, parts, w, 1e-6)
    expected = x + parts.total()
    assert torch.equal(residual, expected)
    assert torch.equal(normed, rms_norm_reference(expected, w, 1e-6))


def test_the_model_defers_exactly_the_products_add_rms_norm_reads(monkeypatch) -> None:
    """o (the split projection) and the MLP's down ask for pending products (`defer=True`), which
    the decoder layer hands to `add_rms_norm`; qkv and gate_up do not. On the CPU, with the FP8
    few-row kernels replaced by stubs that record how they are called."""
    from mmpipe.language import qwen2

    from mmpipe.layers.fp8 import Fp8Linear
    from mmpipe.layers.mlp import GatedMLP

    calls = []
    gated_usable = True

    def split(name: str):
        def product(x, weight, scale, defer=False):
            calls.append((name, defer))
            return torch.zeros(x.shape[0], weight.shape[0])
        return product

    def linear(x, weight, scale, bias=None):
        calls.append(("linear", None))
        return torch.zeros(x.shape[0], weight.shape[0])

    monkeypatch.setattr(gemv_fp8, "fp8_usable", lambda *args, gated=False: gated_usable or not gated)
    monkeypatch.setattr(gemv_fp8, "fp8_linear_split", split("split"))
    monkeypatch.setattr(gemv_fp8, "fp8_gated_linear_split", split("gated"))
    monkeypatch.setattr(gemv_fp8, "fp8_linear", linear)

    def fp8(n: int, k: int) -> Fp8Linear:
        return Fp8Linear(torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(n), None)

    x = torch.randn(1, 32)
    qwen2._project(fp8(16, 32), x, split=True)  # o
    qwen2._project(fp8(16, 32), x)  # qkv
    mlp = GatedMLP(32, 64, "silu", bias=False, few_row_kernels=True)
    mlp.gate_up_proj, mlp.down_proj = fp8(128, 32), fp8(32, 64)
    mlp(x)  # down forms the SiLU product as it reads
    gated_usable = False
    mlp(x)  # down after silu_mul
    assert calls == [("split", True), ("linear", None), ("linear", None), ("gated", True), ("linear", None),
                     ("split", True)]


def test_split_rule_gives_every_slice_work_and_splits_only_narrow_products() -> None:
    for rows, fp8 in itertools.product((1, 2, 8, 32), (False, True)):
        for n, k in ((2048, 11008), (2048, 2048), (22016, 2048), (64, 64), (2048, 1024), (151936, 2048)):
            splits = gemv_kernels.k_splits(rows, n, k, fp8)
            assert splits >= 1 and splits & (splits - 1) == 0
            assert k // splits >= 512 or splits == 1, (rows, n, k, fp8, splits)
    # An FP8 weight is half the bytes per slice: more slices keep as many bytes in flight.
    assert gemv_kernels.k_splits(1, 2048, 11008, fp8=True) > gemv_kernels.k_splits(1, 2048, 11008)
    assert gemv_kernels.k_splits(8, 2048, 11008, fp8=True) > gemv_kernels.k_splits(8, 2048, 11008)
    assert gemv_kernels.k_splits(1, 2048, 11008) > 1  # long K, one row: the serial loop is split
    assert gemv_kernels.k_splits(8, 2048, 2048) > 1  # few output tiles: more programs
    assert gemv_kernels.k_splits(8, 22016, 2048) == 1  # enough tiles already


def test_configs_keep_the_kernels_assumptions_for_every_row_count_and_k() -> None:
    """What `gemv_kernels.run` launches: slices that cover K with none empty (the count `split_product`
    allocates), a one-row BLOCK_N that divides 128 and a several-row BLOCK_K of 128 starting each
    slice on a 128 boundary (both read one 128 x 128 block scale per tile), FP8 or not."""
    for rows, fp8 in itertools.product((1, 2, 8, 32), (False, True)):
        for k in (64, 129, 1000, 2048, 3584, 8960, 11008, 18944, 29568):
            for n in (2048, 22016):
                splits = gemv_kernels.k_splits(rows, n, k, fp8)
                k_split = gemv_kernels.k_slice(rows, k, splits, fp8)
                splits = gemv_kernels.cdiv(k, k_split)  # as split_product rounds it
                assert gemv_kernels.k_slice(rows, k, splits, fp8) == k_split, (rows, fp8, k)
                assert (splits - 1) * k_split < k <= splits * k_split  # covered, no empty slice
                block_n, block_k, _ = gemv_kernels._config(rows, k, splits, fp8)
                if rows == 1:
                    assert 128 % block_n == 0
                elif k >= 128:
                    assert block_k == 128 and k_split % 128 == 0, (rows, fp8, k, k_split)


# ------------------------------------------------------------------------------------------- GPU


SHAPES = [(100, 72), (257, 2048), (2048, 11008)]  # odd N, odd K, the 3B down projection's
ROWS = [1, 2, 3, 8, 13, 24, 32]


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.gpu
@pytest.mark.gpu
def test_kernels_match_cublas(n: int, k: int, rows: int, bias: bool, dtype: torch.dtype) -> None:
    x, w, b = _operands(rows, n, k, dtype, seed=rows * 7 + n)
    b = b if bias else None
    assert gemv.usable(x, w)
    ours = gemv.kernel_linear(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    cublas = F.linear(x, w, b)
    assert ours.dtype == dtype and ours.shape == (rows, n)
    err = (ours.double() - exact).abs()
    if dtype == torch.float32:  # no TF32: float32 accumulation error only
        assert err.max().item() < 1e-5 * k**0.5, err.max().item()
    else:  # one rounding to the dtype after a float32 sum: within an ulp of the exact product
        bound = torch.finfo(dtype).eps * exact.abs() + 1e-3 * exact.abs().mean()
        assert (err <= bound).all(), (err - bound).max().item()
        assert (cublas.double() - exact).abs().max().item() > 0  # the comparison is not on exact values


@pytest.mark.parametrize("rows", [1, 8, 32])
@pytest.mark.gpu
@pytest.mark.gpu
def test_split_products_are_partial_sums_of_the_same_product(rows: int) -> None:
    for n, k in ((2048, 11008), (2048, 2048)) if rows > 1 else ((2048, 11008), (64, 20000)):
        x, w, _ = _operands(rows, n, k, torch.float32, seed=rows + k)
        split = gemv.linear_split(x, w)
        assert isinstance(split, PartialSums) and 1 < split.sums.shape[0] <= gemv_kernels.k_splits(rows, n, k)
        exact = F.linear(x.double(), w.double())
        assert (split.total().double() - exact).abs().max().item() < 1e-5 * k**0.5
        assert split.sums.abs().sum(dim=(1, 2)).min() > 0  # every slice holds a share of K


@pytest.mark.gpu
@pytest.mark.gpu
def test_fused_norm_consumes_partial_sums_bit_exactly() -> None:
    x, w, _ = _operands(8, 2048, 11008, torch.bfloat16, seed=3)
    residual = torch.randn(8, 2048, device="cuda").to(torch.bfloat16)
    norm_w = torch.rand(2048, device="cuda").to(torch.bfloat16) + 0.5
    split = gemv.linear_split(x, w)
    assert isinstance(split, PartialSums)
    got = add_rms_norm(residual, split, norm_w, 1e-6)
    want = add_rms_norm(residual, split.total(), norm_w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# (N, K, gated) of one-row FP8 products split over K: o, down and its gated form on the 3B shape,
# a row narrower than its power-of-two block (1536, 4 slices), a narrow product of 8 slices.
TAIL_CASES = [(2048, 2048, False), (2048, 11008, False), (2048, 2 * 11008, True), (1536, 4096, False),
              (96, 8192, False)]


def _tail_operands(n: int, k: int, gated: bool, dtype: torch.dtype, seed: int = 0):
    """x, residual, norm weight and a function making the FP8 product of x (per-channel scales;
    `defer` passed on)."""
    from mmpipe.kernels.fp8_quant import quantize_per_row

    g = torch.Generator(device="cuda").manual_seed(n + k + seed)
    x = (torch.randn(1, k, device="cuda", generator=g) * (3 if gated else 1)).to(dtype)
    w8, scale = quantize_per_row(torch.randn(n, k // 2 if gated else k, device="cuda", generator=g) / 16)
    residual = (torch.randn(1, n, device="cuda", generator=g) * 4).to(dtype)
    norm_w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(dtype)
    product = gemv_fp8.fp8_gated_linear_split if gated else gemv_fp8.fp8_linear_split
    return x, residual, norm_w, lambda defer=True: product(x, w8, scale, defer=defer)


def _counters_at_zero() -> bool:
    return all(counter.item() == 0 for counter in partial_sums._counters.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.gpu
def test_one_row_product_adds_and_norms_in_its_last_program(dtype: torch.dtype) -> None:
    """A one-row K-split FP8 product asked for with `defer` comes pending; `add_rms_norm` launches
    it with the residual add and the norm done by its last program. The same bits as the norm
    kernel adding the same partial sums, the same partial sums, the arrival counter back at zero,
    and 30 launches in a row (programs arriving in another order each time) all alike. Without
    `defer`, products that do not split and bfloat16 weights: launched at once; rows wider than
    2048: pending, but the norm kernel adds them (launched when it reads `sums`)."""
    from mmpipe.layers.fp8 import fp8_available

    if not fp8_available(torch.device("cuda")):
        pytest.skip("FP8 weights need compute capability 8.9+")
    for n, k, gated in TAIL_CASES:
        _, residual, norm_w, product = _tail_operands(n, k, gated, dtype)
        plain = product(defer=False)
        assert isinstance(plain, PartialSums) and plain._pending is None and plain.sums.shape[0] > 1
        assert plain.add_rms_norm_in_product(residual, norm_w, 1e-6) is None  # launched already
        want = add_rms_norm(residual, plain.total(), norm_w, 1e-6)
        for _ in range(30):
            pending = product()
            got = pending.add_rms_norm_in_product(residual, norm_w, 1e-6)
            assert got is not None, (n, k, gated)  # the tail ran
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (n, k, gated)
            assert torch.equal(pending.sums, plain.sums)
            assert _counters_at_zero()
        through_the_norm = add_rms_norm(residual, product(), norm_w, 1e-6)  # how the model calls it
        assert torch.equal(through_the_norm[0], want[0]) and torch.equal(through_the_norm[1], want[1])
        assert not torch.equal(got[1], residual)  # (the norm was applied: not the residual passed through)
    _, residual, norm_w, product = _tail_operands(3584, 2 * 18944, True, dtype)
    assert product().add_rms_norm_in_product(residual, norm_w, 1e-6) is None  # 7B's hidden: the norm kernel
    x, w, _ = _operands(1, 2048, 11008, dtype, seed=1)
    assert gemv.linear_split(x, w)._pending is None  # bfloat16 weights: launched at once
    x8 = _tail_operands(2048, 512, False, dtype)[3]()
    assert isinstance(x8, torch.Tensor)  # K too short to split: a tensor, no partial sums


@pytest.mark.gpu
def test_one_row_tail_replays_in_a_cuda_graph_and_falls_back_where_it_cannot(switch, monkeypatch) -> None:
    """Two chained adds captured in one graph, replayed on new inputs: the eager results each time
    (the counter is reset inside the graph). Switched off, or captured before any counter exists,
    the separate norm kernel runs: the same bits (hidden 2048)."""
    from mmpipe.kernels.fp8_quant import quantize_per_row
    from mmpipe.layers.fp8 import fp8_available

    if not fp8_available(torch.device("cuda")):
        pytest.skip("FP8 weights need compute capability 8.9+")
    x, residual, norm_w, first = _tail_operands(2048, 4096, False, torch.bfloat16)
    w2, s2 = quantize_per_row(torch.randn(2048, 2048, device="cuda") / 16)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        r1, h1 = add_rms_norm(residual, first(), norm_w, 1e-6)
        return add_rms_norm(r1, gemv_fp8.fp8_linear_split(h1, w2, s2, defer=True), norm_w, 1e-6)

    calls = []  # whether each add ran in the product's last program
    tail = PartialSums.add_rms_norm_in_product

    def recorded(self: PartialSums, *args):
        done = tail(self, *args)
        calls.append(done is not None)
        return done

    monkeypatch.setattr(PartialSums, "add_rms_norm_in_product", recorded)
    step()
    assert calls == [True, True]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    assert calls[-2:] == [True, True]
    for seed in range(4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(x.dtype))
        residual.copy_((torch.randn(residual.shape, device="cuda", generator=g) * 4).to(x.dtype))
        graph.replay()
        want = step()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), seed
    assert _counters_at_zero()

    switch("decode-norm-fusion", "0")
    calls.clear()
    off = step()
    assert calls == [False, False] and torch.equal(off[0], want[0]) and torch.equal(off[1], want[1])
    switch("decode-norm-fusion", "1")
    monkeypatch.setattr(partial_sums, "_counters", {})
    calls.clear()
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph2, stream=stream):
        out2 = step()
    assert calls == [False, False] and partial_sums._counters == {}  # none made inside a capture
    graph2.replay()
    torch.cuda.synchronize()
    assert torch.equal(out2[0], want[0]) and torch.equal(out2[1], want[1])


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.gpu
@pytest.mark.gpu
def test_gated_product_equals_silu_mul_then_product(rows: int) -> None:
    """The SiLU product formed while reading the down projection: the same bits as silu_mul's."""
    from mmpipe.kernels.fused import silu_mul

    for dtype in (torch.bfloat16, torch.float32):
        _, w, _ = _operands(1, 2048, 11008, dtype, seed=rows)
        gate_up = (torch.randn(rows, 2 * 11008, device="cuda") * 3).to(dtype)  # silu's curved part and tails
        assert gemv.usable(gate_up, w, gated=True) and not gemv.usable(gate_up, w)
        fused, plain = gemv.gated_linear_split(gate_up, w), gemv.linear_split(silu_mul(gate_up), w)
        if isinstance(plain, PartialSums):
            assert isinstance(fused, PartialSums) and torch.equal(fused.sums, plain.sums)
        else:
            assert torch.equal(fused, plain)
    with pytest.raises(ValueError, match="gated_linear_split"):
        gemv.gated_linear_split(gate_up[:, :11008], w)


@pytest.mark.gpu
@pytest.mark.gpu
def test_rows_do_not_depend_on_padding_rows() -> None:
    """A decode batch padded to its bucket must compute its real rows bit for bit as unpadded."""
    for real, bucket in ((2, 4), (3, 4), (5, 8), (13, 16), (20, 24), (24, 32)):
        x, w, b = _operands(bucket, 2560, 2048, torch.bfloat16, seed=real)
        x[real:] = float("nan")  # graph padding rows hold whatever the buffer held
        padded = gemv.kernel_linear(x, w, b)
        alone = gemv.kernel_linear(x[:real].contiguous(), w, b)
        assert torch.equal(padded[:real], alone), (real, bucket)
        split_p, split_a = gemv.linear_split(x, w), gemv.linear_split(x[:real].contiguous(), w)
        assert torch.equal(split_p.total()[:real], split_a.total()), (real, bucket)


@pytest.mark.gpu
@pytest.mark.gpu
def test_float32_output_is_the_rounded_product_widened() -> None:
    """The LM head: logits rounded to the model dtype, then widened, in one kernel."""
    for rows in (1, 4):
        x, w, _ = _operands(rows, 1000, 256, torch.bfloat16, seed=rows)
        logits = gemv.kernel_linear(x, w, out_dtype=torch.float32)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, gemv.kernel_linear(x, w).float())


@pytest.mark.gpu
@pytest.mark.gpu
def test_switch_and_unsupported_inputs_fall_back(switch) -> None:
    x, w, _ = _operands(4, 64, 64, torch.bfloat16, seed=0)
    assert gemv.usable(x, w)
    assert not gemv.usable(torch.randn(gemv.MAX_ROWS + 1, 64, device="cuda").to(torch.bfloat16), w)
    assert not gemv.usable(x, w.t().contiguous().t())  # column-major weight
    assert not gemv.usable(x.float(), w)  # mixed dtypes
    switch("gemv", "0")
    assert not gemv.usable(x, w)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="kernel_linear"):
        gemv.kernel_linear(x, w)


@pytest.mark.gpu
@pytest.mark.gpu
def test_linear_routes_several_rows_of_a_narrow_product_to_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several rows x few output tiles (qkv) go to cuBLAS; one row, or many tiles, to the kernels."""
    calls = []
    monkeypatch.setattr(gemv, "kernel_linear", lambda *a, **k: calls.append(a[1].shape) or F.linear(a[0], a[1]))
    for rows, n in ((8, 2560), (1, 2560), (8, 22016)):
        x, w, _ = _operands(rows, n, 256, torch.bfloat16, seed=rows)
        gemv.linear(x, w)
    assert calls == [(2560, 256), (22016, 256)]


def test_allowed_turns_the_kernels_off_in_its_block_and_thread() -> None:
    import threading

    if gemv.triton is None:
        pytest.skip("needs Triton")
    seen = []
    assert gemv.enabled()
    with gemv.allowed(False):
        assert not gemv.enabled()
        with gemv.allowed(True):
            assert gemv.enabled()
        assert not gemv.enabled()
        worker = threading.Thread(target=lambda: seen.append(gemv.enabled()))
        worker.start()
        worker.join()
    assert gemv.enabled() and seen == [True]  # another thread keeps its own setting
