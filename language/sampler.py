"""Token sampling for a batch, vectorised on the device: no Python loop over rows.

Per row: repetition penalty, a ban on stop tokens before `min_new_tokens`, then greedy, or
temperature / top-k / top-p / min-p followed by an exponential race (argmax of p / Exp(1)
noise), which samples exactly from p. The noise comes from a counter-based hash of (seed, step,
token id) computed with integer tensor ops, so a seeded request draws the same numbers whatever
else is in the batch, on the CPU and on CUDA alike.

Log-probabilities are those of the model's distribution (log-softmax of the raw logits), like
vLLM's default, whatever the sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x045D9F3B  # < 2**31, so products of 32-bit values fit in int64 without overflow
_GOLDEN = 0x9E3779B1


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors; build with `SamplingBatch.build`."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    penalty: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64 (tokens generated so far)
    banned: torch.Tensor | None  # [B, K] int64 token ids to forbid (-1 = none)
    seen: torch.Tensor | None  # [B, S] int64 token ids seen so far, for the penalty (-1 = none)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int

    @classmethod
    def build(cls, *, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
              min_p: Sequence[float], penalty: Sequence[float], seeds: Sequence[int], steps: Sequence[int],
              banned: Sequence[Sequence[int]], seen: Sequence[Sequence[int]] | None, max_logprobs: int,
              device: torch.device) -> "SamplingBatch":
        def f32(values: Sequence[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

        def i64(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        any_penalty = any(p != 1.0 for p in penalty)
        return cls(
            temperature=f32(temperature), top_k=i64(top_k), top_p=f32(top_p), min_p=f32(min_p),
            penalty=f32(penalty), seeds=i64([s & _MASK32 for s in seeds]), steps=i64(steps),
            banned=_padded(banned, device) if any(banned) else None,
            seen=_padded(seen, device) if (any_penalty and seen is not None) else None,
            all_greedy=all(t == 0.0 for t in temperature),
            any_top_k=any(k > 0 for k, t in zip(top_k, temperature) if t > 0),
            any_top_p=any(p < 1.0 for p, t in zip(top_p, temperature) if t > 0),
            any_min_p=any(p > 0.0 for p, t in zip(min_p, temperature) if t > 0),
            max_logprobs=max_logprobs,
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    token_logprobs: torch.Tensor | None  # [B] float32, logprob of the chosen token
    top_ids: torch.Tensor | None  # [B, max_logprobs] int64
    top_logprobs: torch.Tensor | None  # [B, max_logprobs] float32


def _padded(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.int64)
    return out.to(device, non_blocking=True)


def _row_mask(like: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A [B, V] bool mask of the token ids listed per row; -1 padding lands in a spare column that
    is cut off (clamping it onto token 0 would let it overwrite a real entry for token 0)."""
    rows, vocab = like.shape
    mask = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=like.device)
    mask.scatter_(1, torch.where(ids >= 0, ids, vocab), True)
    return mask[:, :vocab]


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * _HASH_MUL & _MASK32
    x = ((x >> 16) ^ x) * _HASH_MUL & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 uniforms in (0, 1), a pure function of (seed, step, column)."""
    base = _hash32((_hash32(seeds) + steps * 2 + 1) & _MASK32)
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _hash32((base[:, None] + cols[None, :] * _GOLDEN) & _MASK32)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """logits [B, V] (float32) -> chosen tokens and, if asked, log-probabilities."""
    logits = logits.float()
    raw = logits
    if batch.seen is not None:
        seen = _row_mask(logits, batch.seen)
        p = batch.penalty[:, None]
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if batch.banned is not None:
        logits = logits.masked_fill(_row_mask(logits, batch.banned), float("-inf"))

    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        tokens = torch.where(batch.temperature == 0, greedy_tokens, _sample_random(logits, batch))

    if batch.max_logprobs <= 0:
        return SampleResult(tokens, None, None, None)
    logprobs = torch.log_softmax(raw, dim=-1)
    top_lp, top_ids = logprobs.topk(batch.max_logprobs, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return SampleResult(tokens, chosen, top_ids, top_lp)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    logits = logits / temperature[:, None]
    if batch.any_top_k or batch.any_top_p:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p, batch.any_top_k, batch.any_top_p)
    probs = torch.softmax(logits, dim=-1)
    if batch.any_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = -torch.log(uniform_noise(batch.seeds, batch.steps, logits.shape[-1]))
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool,
                 use_p: bool) -> torch.Tensor:
    """Keep, per row, the k best tokens and the smallest set whose probability reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        remove |= ranks >= k[:, None]
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        remove |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
