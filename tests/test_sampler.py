"""The vectorised sampler: each rule on its own, seeded reproducibility, and the distribution."""

from __future__ import annotations

import pytest
import torch

from mmpipe.language.sampler import SamplingBatch, sample, uniform_noise

CPU = torch.device("cpu")


def batch(n, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, seeds=None, steps=None,
          banned=None, seen=None, logprobs=0):
    def per_row(value):
        return list(value) if isinstance(value, (list, tuple)) else [value] * n

    return SamplingBatch.build(
        temperature=per_row(temperature), top_k=per_row(top_k), top_p=per_row(top_p), min_p=per_row(min_p),
        penalty=per_row(penalty), seeds=seeds or list(range(n)), steps=steps or [0] * n,
        banned=banned or [[] for _ in range(n)], seen=seen, max_logprobs=logprobs, device=CPU)


def logits(n, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    x = logits(6)
    result = sample(x, batch(6, temperature=0.0, logprobs=3))
    assert torch.equal(result.tokens, x.argmax(-1))
    ref = torch.log_softmax(x, -1)
    assert torch.allclose(result.top_logprobs, ref.topk(3, -1).values)
    assert torch.allclose(result.token_logprobs, ref.gather(1, result.tokens[:, None])[:, 0])


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    x = logits(8)
    alone = sample(x[3:4], batch(1, seeds=[1234], steps=[7])).tokens
    for other_seed in range(5):
        mixed = batch(8, temperature=[0.0, 1.0, 0.7, 1.0, 1.0, 0.0, 2.0, 1.0], top_k=[0, 5, 0, 0, 3, 0, 0, 9],
                      seeds=[other_seed] * 3 + [1234] + [other_seed + 9] * 4, steps=[0, 1, 2, 7, 4, 5, 6, 7])
        assert sample(x, mixed).tokens[3] == alone[0]


def test_noise_is_uniform_and_depends_on_seed_and_step():
    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 20000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u, uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 20000))


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    x = probs.log().expand(n, 4)
    tokens = sample(x, batch(n, seeds=list(range(n)))).tokens
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_temperature_sharpens():
    x = torch.tensor([[1.0, 0.0, -1.0]]).expand(3000, 3)
    cold = sample(x, batch(3000, temperature=0.1)).tokens
    hot = sample(x, batch(3000, temperature=5.0)).tokens
    assert (cold == 0).float().mean() > 0.99
    assert 0.2 < (hot == 2).float().mean() < 0.4


def test_top_k_top_p_min_p_restrict_the_support():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).expand(2000, 6)
    assert set(sample(x, batch(2000, top_k=2)).tokens.tolist()) == {0, 1}
    p = torch.softmax(x[0], -1)  # 0.64, 0.23, 0.09, ...
    assert set(sample(x, batch(2000, top_p=0.8)).tokens.tolist()) == {0, 1}
    assert set(sample(x, batch(2000, top_p=0.5)).tokens.tolist()) == {0}
    assert set(sample(x, batch(2000, min_p=0.1)).tokens.tolist()) == {0, 1, 2}  # p2/p0 = 0.135
    assert p[2] / p[0] > 0.1 > p[3] / p[0]


def test_per_row_settings_mix():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).expand(4, 4).contiguous()
    out = sample(x, batch(4, temperature=[0.0, 1.0, 1.0, 1.0], top_k=[0, 1, 0, 0], top_p=[1.0, 1.0, 0.01, 1.0],
                          seeds=[1, 2, 3, 4]))
    assert out.tokens[:3].tolist() == [0, 0, 0]


def test_token_zero_can_be_banned_and_penalised_in_a_padded_batch():
    """Rows with fewer entries are padded with -1; padding must not erase a real entry for token 0."""
    x = torch.tensor([[5.0, 4.0, 1.0, 0.0]]).expand(2, 4).contiguous()
    out = sample(x, batch(2, temperature=0.0, banned=[[0], [2, 3]]))
    assert out.tokens.tolist() == [1, 0]
    out = sample(x, batch(2, temperature=0.0, penalty=[3.0, 3.0], seen=[[0], [2, 3]]))
    assert out.tokens.tolist() == [1, 0]


def test_banned_tokens_and_repetition_penalty():
    x = torch.tensor([[5.0, 4.0, -1.0, -2.0]]).expand(2, 4).contiguous()
    out = sample(x, batch(2, temperature=0.0, banned=[[0], []]))
    assert out.tokens.tolist() == [1, 0]
    # penalty 3 on token 0: 5/3 < 4 -> token 1; on token 3 (negative): pushed further down
    out = sample(x, batch(2, temperature=0.0, penalty=[3.0, 1.0], seen=[[0, 3], [0, 3]], logprobs=1))
    assert out.tokens.tolist() == [1, 0]
    # logprobs stay those of the raw model distribution
    assert torch.allclose(out.top_logprobs[:, 0], torch.log_softmax(x, -1)[:, 0])


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(min_p=2), dict(max_new_tokens=0), dict(logprobs=-1), dict(stop=[""]),
                                 dict(min_new_tokens=5, max_new_tokens=2), dict(temperature=float("nan")),
                                 dict(repetition_penalty=0)])
def test_sampling_params_validation(bad):
    from mmpipe import InputError, SamplingParams

    with pytest.raises(InputError, match="SamplingParams"):
        SamplingParams(**bad)
