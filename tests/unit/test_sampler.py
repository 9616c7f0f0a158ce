"""The graph-safe sampler: each knob's effect on the sampled distribution, seeded reproducibility
whatever the batch, the device-side state (build, write_rows, rows, advance) and graph safety."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch
from mmpipe.language.sampler import (
    RowSampling,
    SampleResult,
    SamplerTensors,
    SamplerVariant,
    _Staged,
    _top_k_top_p,
    advance,
    logprobs_bucket,
    sample,
    uniform_noise,
)
from torch.overrides import TorchFunctionMode

from tests.helpers import HostKernels

CPU = torch.device("cpu")
N = 8000  # seeded rows per empirical distribution: a frequency's standard deviation is <= 0.0056
TOL = 0.025
EVERYTHING = SamplerVariant(random=True, top_k_top_p=True, min_p=True, penalty=True, ban=True, logprobs=8)


def logits(n, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def run(rows, x, variant=None, **build):
    t = SamplerTensors.build(rows, x.shape[-1], CPU, **build)
    return sample(x, t, variant or SamplerVariant.of(rows))


def frequencies(logit_row, n=N, neighbour=None, **settings):
    """Empirical distribution of the token drawn for one row of logits by n rows seeded 0..n-1;
    with `neighbour` logits, each of those rows sits next to a greedy row of them (rows must not mix)."""
    settings.setdefault("temperature", 1.0)
    x = torch.as_tensor(logit_row, dtype=torch.float32).expand(n, -1)
    rows = [RowSampling(seed=i, **settings) for i in range(n)]
    if neighbour is not None:
        x = torch.stack([x, torch.as_tensor(neighbour, dtype=torch.float32).expand(n, -1)], 1).flatten(0, 1)
        rows = [row for pair in zip(rows, [RowSampling()] * n) for row in pair]
    tokens = run(rows, x.contiguous()).tokens[:: 1 if neighbour is None else 2]
    return torch.bincount(tokens, minlength=x.shape[-1]).float() / n


def renormalised(probs, keep):
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def support(freq):
    return set(freq.nonzero()[:, 0].tolist())


def same_result(a, b, k=None):
    """Bit-identical tokens and log-probabilities (the first k top entries of each)."""
    k = a.top_ids.shape[1] if k is None else k
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.token_logprobs, b.token_logprobs)
            and torch.equal(a.top_ids[:, :k], b.top_ids[:, :k])
            and torch.equal(a.top_logprobs[:, :k], b.top_logprobs[:, :k]))


# ---------------------------------------------------------------- variants


def test_logprobs_bucket():
    asked = (0, 1, 2, 3, 5, 8, 9, 33, 64, 65, 100)
    assert [logprobs_bucket(k) for k in asked] == [0, 1, 2, 4, 8, 8, 16, 64, 64, 100, 100]
    with pytest.raises(ValueError):
        logprobs_bucket(101)


def test_variant_of_switches_on_only_what_the_rows_use():
    assert SamplerVariant.of([]) == SamplerVariant.of([RowSampling()]) == SamplerVariant()
    # knobs of greedy rows change nothing, so they turn nothing on
    greedy_with_knobs = RowSampling(top_k=5, top_p=0.5, min_p=0.3, logprobs=3)
    assert SamplerVariant.of([greedy_with_knobs]) == SamplerVariant(logprobs=4)
    assert SamplerVariant.of([RowSampling(temperature=0.7)]) == SamplerVariant(random=True)
    assert SamplerVariant.of([RowSampling(), RowSampling(temperature=1.0, top_k=5)]) == SamplerVariant(
        random=True, top_k_top_p=True)
    assert SamplerVariant.of([RowSampling(temperature=1.0, top_p=0.9)]).top_k_top_p
    min_p = SamplerVariant.of([RowSampling(temperature=1.0, min_p=0.1)])
    assert min_p == SamplerVariant(random=True, min_p=True)
    assert SamplerVariant.of([RowSampling(penalty=1.2)]) == SamplerVariant(penalty=True)
    penalised = SamplerVariant.of([RowSampling(penalty=0.8, temperature=0.5)])
    assert penalised == SamplerVariant(random=True, penalty=True)
    # a ban needs ids and a step below ban_until
    assert SamplerVariant.of([RowSampling(ban_ids=(2,), step=3, ban_until=4)]) == SamplerVariant(ban=True)
    assert not SamplerVariant.of([RowSampling(ban_ids=(2,), step=4, ban_until=4)]).ban
    assert not SamplerVariant.of([RowSampling(ban_until=4)]).ban
    assert SamplerVariant.of([RowSampling(logprobs=5), RowSampling(logprobs=20)]).logprobs == 32


# ---------------------------------------------------------------- tensors


def test_build_packs_rows_and_pads_ban_ids():
    rows = [RowSampling(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, penalty=1.3, seed=2**40 + 7, step=4,
                        ban_ids=(0, 5), ban_until=6, seen_ids=(1, 1, 3), logprobs=2),
            RowSampling(seed=-1, ban_ids=(9,), seen_ids=[0]),
            RowSampling()]
    t = SamplerTensors.build(rows, 10, CPU)
    f32 = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    assert torch.equal(t.temperature, f32(0.5, 0, 0)) and torch.equal(t.top_p, f32(0.9, 1, 1))
    assert torch.equal(t.min_p, f32(0.1, 0, 0)) and torch.equal(t.penalty, f32(1.3, 1, 1))
    ints = ("top_k", "seeds", "steps", "ban_ids", "ban_until")
    assert all(getattr(t, name).dtype == torch.int64 for name in ints)
    assert t.top_k.tolist() == [3, 0, 0] and t.steps.tolist() == [4, 0, 0]
    assert t.ban_until.tolist() == [6, 0, 0]
    assert t.seeds.tolist() == [7, 2**32 - 1, 0]  # masked to 32 bits
    assert t.ban_ids.tolist() == [[0, 5], [9, -1], [-1, -1]]
    assert t.seen.dtype == torch.bool and t.seen.shape == (3, 10)
    assert t.seen.nonzero().tolist() == [[0, 1], [0, 3], [1, 0]]
    assert SamplerTensors.build(rows, 10, CPU, ban_width=4).ban_ids.tolist()[1] == [9, -1, -1, -1]
    assert SamplerTensors.build([RowSampling()], 10, CPU).ban_ids.tolist() == [[-1]]  # at least one column
    assert SamplerTensors.build([RowSampling(seen_ids=(1,))], 10, CPU).seen is None  # no penalty, no mask
    with pytest.raises(ValueError):
        SamplerTensors.build(rows, 10, CPU, ban_width=1)


def test_staging_rows_runs_no_torch_host_kernel():
    """Rows join a decode batch many times a second. Torch's host kernels there (its
    repeat_interleave for any two rows, a cat past 32768 elements) woke its OpenMP threads, which
    spun on every core: a third of a captioning run's CPU. The staging is numpy's."""
    rows = [RowSampling(penalty=1.1, temperature=0.7, seen_ids=range(i, i + 3000), ban_ids=(1, i)) for i in range(16)]
    with HostKernels() as host:
        staged = _Staged(rows, 50_000, 2, True, CPU)
        staged.tensors()  # on the CPU, only the device half (the mask) may run kernels
    assert not [name for name in host.calls if "zeros" not in name and "index_fill" not in name], host.calls
    assert staged.ints.shape == (16 * 4 + 16 * 2 + 16 * 3000,)


def test_rows_are_views_of_the_first_rows():
    t = SamplerTensors.build([RowSampling(penalty=1.5, step=i, ban_ids=(i,), frequency=0.5, output_ids=(i,))
                              for i in range(4)], 8, CPU)
    t.allowed = torch.full((4, 1), -1, dtype=torch.int32)
    v = t.rows(2)
    for f in fields(t):
        whole, part = getattr(t, f.name), getattr(v, f.name)
        assert part.shape == (2, *whole.shape[1:]) and part.data_ptr() == whole.data_ptr()
    v.steps += 10
    v.seen[1, 3] = True
    assert t.steps.tolist() == [10, 11, 2, 3] and bool(t.seen[1, 3])


def test_write_rows_then_sample_equals_build_then_sample():
    vocab = 64
    x = logits(5, vocab, seed=1)
    rows = [RowSampling(temperature=0.8, top_k=10, seed=11, step=3, penalty=1.4, seen_ids=(1, 2, 60),
                        logprobs=3),
            RowSampling(seed=12, ban_ids=(int(x[1].argmax()),), ban_until=2, logprobs=1),
            RowSampling(temperature=1.3, top_p=0.7, min_p=0.05, seed=13, step=9,
                        seen_ids=(int(x[2].argmax()),)),
            RowSampling(temperature=0.6, seed=2**33 + 14, penalty=0.7, seen_ids=tuple(range(0, 64, 3))),
            RowSampling(temperature=1.0, ban_ids=(0, 1, 2), step=1, ban_until=3, seed=15)]
    # a static batch of 8 full of stale settings, seen marks and ban ids everywhere
    stale = RowSampling(temperature=2.0, top_k=3, top_p=0.5, min_p=0.5, penalty=1.5, seed=99, step=50,
                        ban_ids=(1, 2, 3, 4), ban_until=100, seen_ids=range(vocab))
    static = SamplerTensors.build([stale] * 8, vocab, CPU)
    static.write_rows(slice(0, 2), rows[:2], vocab)
    static.write_rows(torch.tensor([4, 2, 3]), [rows[4], rows[2], rows[3]], vocab)
    fresh = SamplerTensors.build(rows, vocab, CPU)  # narrower ban_ids, its own buffers
    assert torch.equal(static.seen[:5], fresh.seen) and static.seen[5:].all()
    assert same_result(sample(x, static.rows(5), EVERYTHING), sample(x, fresh, EVERYTHING))
    with pytest.raises(ValueError):
        static.write_rows(slice(0, 1), [RowSampling(ban_ids=(1, 2, 3, 4, 5))], vocab)


def test_advance_moves_only_active_rows_and_marks_seen_only_with_a_penalty():
    t = SamplerTensors.build([RowSampling(penalty=1.5, step=s, seen_ids=(0,)) for s in (5, 6, 7, 8)], 10, CPU)
    tokens, active = torch.tensor([1, 2, 3, 4]), torch.tensor([True, False, True, False])
    seen = t.seen.clone()

    advance(t, tokens, SamplerVariant(), active)
    assert t.steps.tolist() == [6, 6, 8, 8] and torch.equal(t.seen, seen)  # no penalty: mask untouched

    advance(t, tokens, SamplerVariant(penalty=True), active)
    seen[0, 1] = seen[2, 3] = True
    assert t.steps.tolist() == [7, 6, 9, 8] and torch.equal(t.seen, seen)

    advance(t, tokens, SamplerVariant(penalty=True))  # no mask: every row
    seen[1, 2] = seen[3, 4] = True
    assert t.steps.tolist() == [8, 7, 10, 9] and torch.equal(t.seen, seen)


def test_decode_steps_with_advance_equal_rebuilding_from_the_host():
    """A persistent batch updated on the device samples what fresh tensors of the host rows do."""
    vocab = 40
    rows = [RowSampling(temperature=1.0, penalty=1.8, seed=5, seen_ids=(3, 4), ban_ids=(0,), ban_until=2),
            RowSampling(penalty=2.0, seen_ids=(7,)),
            RowSampling(temperature=0.7, top_k=8, seed=6, step=4, ban_ids=(1, 2), ban_until=6)]
    variant = SamplerVariant.of(rows)
    state = SamplerTensors.build(rows, vocab, CPU)
    for step in range(6):
        x = logits(3, vocab, seed=100 + step)
        tokens = sample(x, state, variant).tokens
        assert torch.equal(tokens, sample(x, SamplerTensors.build(rows, vocab, CPU), variant).tokens)
        advance(state, tokens, variant)
        rows = [replace(r, step=r.step + 1, seen_ids=(*r.seen_ids, tok))
                for r, tok in zip(rows, tokens.tolist())]


# ---------------------------------------------------------------- noise


def _reference_uniform(seed, step, col):
    """The counter-based noise in plain Python integers: the numbers seeded requests have always drawn."""
    def h(x):
        x = ((x >> 16) ^ x) * 0x045D9F3B & 0xFFFFFFFF
        x = ((x >> 16) ^ x) * 0x045D9F3B & 0xFFFFFFFF
        return (x >> 16) ^ x

    base = h((h(seed) + step * 2 + 1) & 0xFFFFFFFF)
    top24 = h((base + col * 0x9E3779B1) & 0xFFFFFFFF) >> 8
    return ((torch.tensor(top24, dtype=torch.float32) + 0.5) * (1.0 / (1 << 24))).item()  # float32 rounding


def test_noise_keeps_its_numbers_and_is_uniform():
    seeds, steps = [0, 1, 1, 2, 2**32 - 1], [0, 0, 1, 0, 123456]
    u = uniform_noise(torch.tensor(seeds), torch.tensor(steps), 20000)
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        for col in (0, 1, 2, 777, 19999):
            assert u[i, col].item() == _reference_uniform(seed, step, col)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[1], u[2]) and not torch.equal(u[1], u[3])


def test_a_noise_draw_of_one_never_picks_a_filtered_token():
    """u rounds to 1.0 in float32 for 2**-24 of the draws (about 1% of rows at this vocabulary), so
    E = -log u = 0: the race must not turn p / 0 into NaN, which argmax would pick."""
    vocab, column = 151936, 79352
    u = uniform_noise(torch.tensor([4]), torch.tensor([0]), vocab)
    assert (u == 1.0).nonzero().tolist() == [[0, column]]
    x = logits(1, vocab, seed=0).expand(3, vocab).contiguous()
    rows = [RowSampling(temperature=1.0, seed=4, top_k=1),
            RowSampling(temperature=1.0, seed=4, ban_ids=(column,), ban_until=1),
            RowSampling(temperature=1.0, seed=4)]
    top_1, banned, free = run(rows, x).tokens.tolist()
    assert top_1 == x[0].argmax().item() and banned != column
    assert free == column  # with p > 0 it wins: the race's limit as E -> 0


# ---------------------------------------------------------------- greedy and log-probabilities


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    x = logits(6)
    result = run([RowSampling(logprobs=3)] * 6, x)  # bucketed to 4
    assert torch.equal(result.tokens, x.argmax(-1))
    ref = torch.log_softmax(x, -1)
    assert result.top_ids.shape == result.top_logprobs.shape == (6, 4)
    assert torch.equal(result.top_ids, ref.topk(4, -1).indices)
    assert torch.allclose(result.top_logprobs, ref.topk(4, -1).values)
    assert (result.top_logprobs[:, :-1] >= result.top_logprobs[:, 1:]).all()
    assert torch.allclose(result.token_logprobs, ref.gather(1, result.tokens[:, None])[:, 0])
    assert run([RowSampling()] * 6, x).top_ids is None


def test_logprobs_are_those_of_the_raw_logits_whatever_the_settings():
    x = logits(4, 20, seed=4)
    rows = [RowSampling(temperature=0.7, top_k=5, penalty=2.0, seen_ids=tuple(range(10)), seed=i, logprobs=5,
                        ban_ids=(int(x[i].argmax()),), ban_until=5) for i in range(4)]
    result = run(rows, x)
    ref = torch.log_softmax(x, -1)
    assert torch.equal(result.top_ids, ref.topk(8, -1).indices)
    assert torch.allclose(result.top_logprobs, ref.topk(8, -1).values)
    assert torch.allclose(result.token_logprobs, ref.gather(1, result.tokens[:, None])[:, 0])


def test_greedy_only_variants_run_argmax_and_only_what_is_asked():
    class Ops(TorchFunctionMode):
        """Names of the torch functions called on a [B, V] tensor."""

        def __init__(self, shape):
            super().__init__()
            self.shape, self.names = shape, []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, torch.Tensor) and a.shape == self.shape for a in args):
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = logits(3, 1000)
    t = SamplerTensors.build([RowSampling(temperature=1.0, top_k=3, min_p=0.1, penalty=1.2, seen_ids=(1,),
                                          ban_ids=(2,), ban_until=9)] * 3, 1000, CPU)

    def big_ops(variant):
        with Ops(x.shape) as ops:
            sample(x, t, variant)
        return [name for name in ops.names if name not in ("float", "__get__")]  # .float() of float32: itself

    assert big_ops(SamplerVariant()) == ["argmax"]
    assert sorted(big_ops(SamplerVariant(logprobs=4))) == ["argmax", "gather", "log_softmax", "topk"]
    for variant in (SamplerVariant(ban=True), SamplerVariant(penalty=True, ban=True, logprobs=2)):
        assert not {"sort", "softmax", "cumsum", "log", "log_"} & set(big_ops(variant))
    assert {"sort", "softmax", "cumsum"} <= set(big_ops(EVERYTHING))  # (the check sees these functions)


# ---------------------------------------------------------------- each knob's effect on the distribution


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.allclose(frequencies(probs.log()), probs, atol=TOL)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_samples_softmax_of_logits_over_temperature(temperature):
    x = torch.tensor([1.0, 0.0, -1.0, 0.5, -2.0])
    expected = torch.softmax(x / temperature, -1)
    assert torch.allclose(frequencies(x, temperature=temperature), expected, atol=TOL)


def test_top_k_keeps_exactly_the_k_best_renormalised():
    x = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.0, 1.0])
    p = torch.softmax(x, -1)
    freq = frequencies(x, top_k=3, neighbour=-x)
    assert support(freq) == {1, 3, 5}
    assert torch.allclose(freq, renormalised(p, [1, 3, 5]), atol=TOL)
    assert torch.allclose(frequencies(x, top_k=100), p, atol=TOL)  # k above the vocabulary keeps everything


@pytest.mark.parametrize("top_p, kept", [(0.49, 1), (0.5, 1), (0.51, 2), (0.74, 2), (0.75, 2), (0.76, 3),
                                         (0.875, 3)])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    x = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0]).log()
    p = torch.softmax(x, -1)
    assert p.tolist() == [0.5, 0.25, 0.125, 0.0625, 0.0625]  # exact: prefix masses 0.5, 0.75, 0.875
    freq = frequencies(x, top_p=top_p, neighbour=x.flip(0))
    assert support(freq) == set(range(kept))
    assert torch.allclose(freq, renormalised(p, list(range(kept))), atol=TOL)


def test_top_p_applies_to_the_top_k_renormalised_mass():
    x = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0]).log()  # top 2 renormalised: 2/3, 1/3
    assert support(frequencies(x, top_k=2, top_p=0.6)) == {0}  # 2/3 >= 0.6 (0.5 alone would not reach it)
    freq = frequencies(x, top_k=2, top_p=0.7)
    assert support(freq) == {0, 1} and torch.allclose(freq[:2], torch.tensor([2 / 3, 1 / 3]), atol=TOL)


def test_min_p_threshold_is_relative_to_the_top_probability():
    p = torch.tensor([0.45, 0.3, 0.15, 0.07, 0.03])
    peaked = torch.tensor([20.0, 0.0, 0.0, 0.0, 0.0])  # a neighbour whose top probability is ~1
    freq = frequencies(p.log(), min_p=0.25, neighbour=peaked)  # keeps p >= 0.25 * 0.45 = 0.1125
    assert support(freq) == {0, 1, 2}
    assert torch.allclose(freq, renormalised(p, [0, 1, 2]), atol=TOL)
    # after the temperature: p' = softmax(log p / 0.5) ~ p^2 -> [0.63, 0.28, 0.07, ...], threshold 0.3 * 0.63
    p2 = torch.softmax(p.log() / 0.5, -1)
    freq = frequencies(p.log(), temperature=0.5, min_p=0.3)
    assert support(freq) == {0, 1} and torch.allclose(freq, renormalised(p2, [0, 1]), atol=TOL)


def test_repetition_penalty_lowers_seen_tokens_of_either_sign():
    x = torch.tensor([1.0, 0.8, -0.5, -0.6, 0.0])
    penalised = torch.tensor([0.5, 0.8, -1.0, -0.6, 0.0])  # seen 0 (positive): / 2; seen 2 (negative): * 2
    freq = frequencies(x, penalty=2.0, seen_ids=(0, 2))
    assert torch.allclose(freq, torch.softmax(penalised, -1), atol=TOL)
    assert (freq[[0, 2]] < torch.softmax(x, -1)[[0, 2]] - 0.015).all()  # both went down (by 0.1 and 0.023)
    # greedy: a seen token with a negative logit is pushed down by exactly the factor
    x = torch.tensor([[-1.0, -1.2, -3.0]]).expand(2, 3).contiguous()
    rows = [RowSampling(penalty=1.5, seen_ids=(0,)), RowSampling(penalty=1.1, seen_ids=(0,))]
    assert run(rows, x).tokens.tolist() == [1, 0]  # -1.5 < -1.2 < -1.1
    # a penalty below 1 promotes seen tokens the other way round
    assert run([RowSampling(penalty=0.5, seen_ids=(1,))], x[:1]).tokens.tolist() == [1]  # -0.6 > -1.0


def test_ban_applies_only_while_step_is_below_ban_until():
    x = torch.tensor([[5.0, 4.0, 1.0, 0.0]]).expand(4, 4).contiguous()
    rows = [RowSampling(ban_ids=(0,), step=step, ban_until=2) for step in range(4)]
    assert run(rows, x).tokens.tolist() == [1, 1, 0, 0]
    y = torch.tensor([1.0, 2.0, 0.5])
    freq = frequencies(y, ban_ids=(1,), ban_until=1)
    assert support(freq) == {0, 2}
    assert torch.allclose(freq, renormalised(torch.softmax(y, -1), [0, 2]), atol=TOL)


def test_token_zero_can_be_banned_and_penalised_in_a_padded_batch():
    """Shorter id lists are padded with -1; padding must not erase or invent an entry for token 0."""
    x = torch.tensor([[5.0, 4.0, 1.0, 0.0]]).expand(3, 4).contiguous()
    rows = [RowSampling(ban_ids=(0,), ban_until=1), RowSampling(ban_ids=(2, 3), ban_until=1), RowSampling()]
    for width in (None, 5):
        assert run(rows, x, ban_width=width).tokens.tolist() == [1, 0, 0]
        assert run(rows[::-1], x, ban_width=width).tokens.tolist() == [0, 0, 1]
    rows = [RowSampling(penalty=3.0, seen_ids=(0,)), RowSampling(penalty=3.0, seen_ids=(2, 3)), RowSampling()]
    assert run(rows, x).tokens.tolist() == [1, 0, 0]


# ---------------------------------------------------------------- rows are independent


def test_unused_parts_leave_rows_bit_identical():
    """A variant with every part on (a graph serving a mixed batch) changes nothing for rows that do not
    use those parts: penalty 1, top-k 0, top-p 1, min-p 0, an expired ban."""
    vocab, n = 300, 48
    x = logits(n, vocab, seed=2)
    rows = [RowSampling(temperature=(0.0, 0.7, 1.3)[i % 3], seed=i, step=i, seen_ids=tuple(range(i, i + 40)),
                        ban_ids=(int(x[i].argmax()),), ban_until=i, logprobs=2) for i in range(n)]
    minimal = SamplerVariant.of(rows)
    assert minimal == SamplerVariant(random=True, logprobs=2)
    t = SamplerTensors.build(rows + [RowSampling(penalty=1.5)], vocab, CPU).rows(n)  # with a seen mask
    result = sample(x, t, EVERYTHING)
    assert same_result(result, sample(x, t, minimal), k=2)
    assert torch.equal(result.tokens[::3], x[::3].argmax(-1))  # temperature 0 rows stay greedy


def test_top_k_0_and_top_p_1_keep_every_token_even_when_the_cumulative_mass_rounds_to_one():
    """Tail tokens of p ~ 4.5e-8 each: every float32 addition near 1 rounds up, so the running mass
    reaches 1.0 with tokens left; a top-p of 1 must not cut them."""
    x = torch.cat([torch.zeros(1), -16.9 - torch.arange(200) * 1e-4])[None]
    p = torch.softmax(x, -1)
    assert ((p.cumsum(-1) - p) >= 1.0).any()  # the premise
    assert torch.equal(_top_k_top_p(x.clone(), torch.tensor([0]), torch.tensor([1.0])), x)
    cut = _top_k_top_p(x.clone(), torch.tensor([0]), torch.tensor([0.999]))  # p0 ~ 0.99999 reaches it alone
    assert torch.isfinite(cut).nonzero().tolist() == [[0, 0]]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch_or_its_size():
    vocab = 100
    x = logits(16, vocab, seed=3)
    target = RowSampling(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, penalty=1.3, seed=1234, step=7,
                         ban_ids=(int(x[3].argmax()),), ban_until=9, seen_ids=(1, 2, 3, 50), logprobs=3)
    alone = sample(x[3:4], SamplerTensors.build([target], vocab, CPU), EVERYTHING)
    for other in range(4):
        others = [RowSampling(temperature=(0.0, 1.0, 0.6, 2.0)[(i + other) % 4], top_k=(0, 5, 0, 50)[i % 4],
                              top_p=(1.0, 0.5, 0.95, 1.0)[i % 4], min_p=0.1 * (i % 2),
                              penalty=(1.0, 0.7, 1.6)[i % 3],
                              seed=other * 10 + i, step=i, ban_ids=tuple(range(i)), ban_until=8,
                              seen_ids=tuple(range(i, 3 * i)), logprobs=i) for i in range(7)]
        batch = others[:3] + [target] + others[3:]
        mixed = sample(x[:8], SamplerTensors.build(batch, vocab, CPU), EVERYTHING)
        padded_tensors = SamplerTensors.build(batch + [RowSampling()] * 8, vocab, CPU, ban_width=9)
        padded = sample(x, padded_tensors, EVERYTHING)
        for result in (mixed, padded):
            assert same_result(alone, SampleResult(*(getattr(result, f.name)[3:4] for f in fields(result))))


# ---------------------------------------------------------------- graph safety


def test_sample_and_advance_need_no_host_sync():
    """On the meta device any .item(), .tolist(), bool(tensor) or data-dependent shape raises."""
    meta = torch.device("meta")
    rows = [RowSampling(temperature=1.0, top_k=3, top_p=0.9, min_p=0.1, penalty=1.2, seen_ids=(1,),
                        ban_ids=(2,), ban_until=9, logprobs=5)] * 4
    t = SamplerTensors.build(rows, 32, meta)
    for n in (4, 1):  # one row takes its own cumsum path
        result = sample(torch.empty(n, 32, device=meta), t.rows(n), EVERYTHING)
        assert result.tokens.shape == (n,) and result.top_ids.shape == result.top_logprobs.shape == (n, 8)
        advance(t.rows(n), result.tokens, EVERYTHING, torch.ones(n, dtype=torch.bool, device=meta))


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    device, rows_max, vocab = torch.device("cuda"), 16, 1000
    gen = torch.Generator().manual_seed(7)
    pad = RowSampling(penalty=1.5)  # padding rows, and one kept so that `seen` exists
    static = SamplerTensors.build([pad] * rows_max, vocab, device, ban_width=4)
    logits_in = torch.zeros(rows_max, vocab, device=device)
    active = torch.zeros(rows_max, dtype=torch.bool, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sample(logits_in, static, EVERYTHING)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(logits_in, static, EVERYTHING)
        advance(static, out.tokens, EVERYTHING, active)

    n = 5
    rows = [RowSampling(temperature=0.8, top_k=10, seed=1, penalty=1.3, seen_ids=(1, 2), logprobs=3),
            RowSampling(seed=2, ban_ids=(0, 1), ban_until=2),
            RowSampling(temperature=1.2, top_p=0.8, min_p=0.05, seed=3, step=4),
            RowSampling(temperature=0.5, seed=4, penalty=0.8, seen_ids=tuple(range(50))),
            RowSampling(temperature=1.0, seed=5, ban_ids=(3,), ban_until=1)]
    static.write_rows(torch.arange(n), rows, vocab)
    active[:n] = True
    eager = SamplerTensors(**{f.name: getattr(static, f.name).clone() for f in fields(static)})
    for _ in range(4):
        logits_in.copy_(torch.randn(rows_max, vocab, generator=gen).mul_(3))
        expected = sample(logits_in.clone(), eager, EVERYTHING)
        advance(eager, expected.tokens, EVERYTHING, active)
        graph.replay()
        torch.cuda.synchronize()
        assert same_result(out, expected)
        for f in fields(static):
            assert torch.equal(getattr(static, f.name), getattr(eager, f.name)), f.name


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(min_p=2), dict(max_new_tokens=0), dict(logprobs=-1), dict(stop=[""]),
                                 dict(min_new_tokens=5, max_new_tokens=2), dict(temperature=float("nan")),
                                 dict(repetition_penalty=0), dict(stop=123), dict(stop=b"x"), dict(stop=[1]),
                                 dict(stop_token_ids=5), dict(stop_token_ids=["7"]), dict(stop_token_ids=[-1]),
                                 dict(stop_token_ids=[True])])
def test_sampling_params_validation(bad):
    from mmpipe import InputError, SamplingParams

    with pytest.raises(InputError, match="SamplingParams"):
        SamplingParams(**bad)


def test_rows_without_a_positive_temperature_are_greedy_in_any_variant():
    """SamplerVariant.of counts a row as sampled only when its temperature is positive; the sampler
    must agree, or a row would be greedy in one graph and sampled in another that covers it."""
    logits_ = torch.tensor([[1.0, 0.9, 0.8, 0.7]]).expand(64, 4).contiguous()
    rows = [RowSampling(temperature=-0.5 if i % 2 else 0.0, seed=i) for i in range(64)]
    tensors = SamplerTensors.build(rows, 4, CPU)
    result = sample(logits_, tensors, SamplerVariant(random=True))
    assert result.tokens.tolist() == [0] * 64


def test_greedy_rows_sample_without_per_row_tensors():
    """Greedy rows (logprobs or not) need no SamplerTensors, so the prefill's first token is
    sampled with no transfer before the argmax; every other part asks for them."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3)) * 4
    rows = [RowSampling(logprobs=2), RowSampling(), RowSampling()]
    variant = SamplerVariant.of(rows)
    assert not variant.needs_tensors
    with_tensors = sample(logits, SamplerTensors.build(rows, 50, "cpu"), variant)
    without = sample(logits, None, variant)
    assert torch.equal(without.tokens, logits.argmax(-1)) and torch.equal(without.tokens, with_tensors.tokens)
    assert torch.equal(without.top_ids, with_tensors.top_ids)
    for row in (RowSampling(temperature=0.7), RowSampling(penalty=1.3, seen_ids=(1,)),
                RowSampling(ban_ids=(4,), ban_until=2)):
        needing = SamplerVariant.of([row])
        assert needing.needs_tensors
        with pytest.raises(ValueError, match="needs SamplerTensors"):
            sample(logits[:1], None, needing)
