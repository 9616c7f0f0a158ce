"""Token sampling for a batch, vectorised on the device and safe to capture in a CUDA graph.

Per row: repetition penalty, frequency and presence penalties, a ban on stop tokens before
`min_new_tokens`, a grammar's mask of allowed tokens (structured output), then greedy, or
temperature / top-k / top-p / min-p followed by an exponential race (argmax of p / Exp(1)
noise), which samples exactly from p. The noise comes from a counter-based hash of (seed, step,
token id) computed with integer tensor ops, so a seeded request draws the same numbers whatever
else is in the batch, on the CPU and on CUDA alike.

Log-probabilities are those of the model's distribution (log-softmax of the raw logits), like
vLLM's default, whatever the sampling settings.

The pieces:

- `RowSampling`: one row's settings on the host.
- `SamplerVariant`: which parts of the sampler run, as host booleans. It is the only thing that
  chooses code paths, so a graph captured for a variant serves any rows whose
  `SamplerVariant.of(rows)` asks for no more than it (a part that is on leaves the rows that do
  not use it bit-identical: x / 1, x * 1, keeping every token, ...).
- `SamplerTensors`: the per-row state as device tensors of fixed shape (a graph's static
  buffers): `build` makes fresh ones, `write_rows` fills rows of preallocated ones in place,
  `rows(n)` takes views of the first n rows.
- `sample(logits, tensors, variant)`: no host sync, no data-dependent shape, no branch on tensor
  values; a row's result depends only on its own logits and settings, never on the other rows
  (padding rows included) or the batch size: every reduction runs per row, and float sums only
  in kernels whose order within a row does not depend on the row count (softmax, log-softmax;
  cumsum with a caveat, see `_top_k_top_p`). Top-k / top-p keep the tokens tied with the last
  one kept (a logit threshold), so no tie is broken by a sort's order.
- `advance(tensors, tokens, variant, active)`: the state update after a decode step, on the
  device (step counters, the penalty's presence mask), so a persistent batch needs no host
  round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from mmpipe.graphs.transfer import to_device

_MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x045D9F3B  # < 2**31, so products of 32-bit values fit in int64 without overflow
_GOLDEN = 0x9E3779B1
_LOGPROB_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 100)


def logprobs_bucket(k: int) -> int:
    """0 -> 0; else the smallest of 1, 2, 4, 8, 16, 32, 64, 100 that is >= k."""
    if k <= 0:
        return 0
    for bucket in _LOGPROB_BUCKETS:
        if bucket >= k:
            return bucket
    raise ValueError(f"logprobs={k} is above the largest supported ({_LOGPROB_BUCKETS[-1]})")


@dataclass(frozen=True)
class RowSampling:
    """One row's settings, host side (plain Python)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    penalty: float = 1.0
    seed: int = 0
    step: int = 0  # tokens generated so far by this request (noise counter)
    ban_ids: tuple[int, ...] = ()  # token ids forbidden while step < ban_until
    ban_until: int = 0
    seen_ids: Sequence[int] = ()  # token ids seen so far (prompt + output), for the penalty
    logprobs: int = 0
    frequency: float = 0.0  # OpenAI's frequency_penalty: logit -= frequency x count in the output
    presence: float = 0.0  # OpenAI's presence_penalty: logit -= presence if the token is in the output
    output_ids: Sequence[int] = ()  # generated so far, for the frequency and presence penalties
    grammar: bool = False  # a grammar's mask (given beside the rows) says which tokens it may take


@dataclass(frozen=True)
class SamplerVariant:
    """Which parts of the sampler run: host booleans fixed for a captured graph (part of its key)."""

    random: bool = False  # some row has temperature > 0
    top_k_top_p: bool = False  # some sampled row uses top-k (>0) or top-p (<1)
    min_p: bool = False  # some sampled row uses min-p > 0
    penalty: bool = False  # some row has repetition_penalty != 1
    ban: bool = False  # some row may have banned tokens (stop/eos ids before min_new_tokens)
    logprobs: int = 0  # number of top logprobs computed, already bucketed (see logprobs_bucket)
    output_penalty: bool = False  # some row has a frequency or presence penalty
    grammar: bool = False  # some row's tokens are constrained by a grammar's mask

    @property
    def needs_tensors(self) -> bool:
        """Whether `sample` reads the rows' `SamplerTensors` (greedy rows with no penalty, ban or
        grammar, logprobs or not, need none: no transfer for them)."""
        return self.random or self.penalty or self.ban or self.output_penalty or self.grammar

    @classmethod
    def of(cls, rows: Sequence[RowSampling]) -> "SamplerVariant":
        """The variant that serves these rows (also at their later steps: a ban only expires)."""
        sampled = [r for r in rows if r.temperature > 0]
        return cls(
            random=bool(sampled),
            top_k_top_p=any(r.top_k > 0 or r.top_p < 1.0 for r in sampled),
            min_p=any(r.min_p > 0.0 for r in sampled),
            penalty=any(r.penalty != 1.0 for r in rows),
            ban=any(r.ban_ids and r.step < r.ban_until for r in rows),
            logprobs=logprobs_bucket(max((r.logprobs for r in rows), default=0)),
            output_penalty=any(r.frequency != 0.0 or r.presence != 0.0 for r in rows),
            grammar=any(r.grammar for r in rows),
        )


@dataclass
class SamplerTensors:
    """Per-row state as device tensors of FIXED shape (views of a graph's static buffers work)."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    penalty: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64, already masked to 32 bits
    steps: torch.Tensor  # [B] int64
    ban_ids: torch.Tensor  # [B, K] int64, -1 = empty entry
    ban_until: torch.Tensor  # [B] int64: row's ban is active while steps < ban_until
    seen: torch.Tensor | None  # [B, V] bool presence mask (None when no row uses a penalty)
    frequency: torch.Tensor | None = None  # [B] float32 (None when no row uses the output penalties)
    presence: torch.Tensor | None = None  # [B] float32
    counts: torch.Tensor | None = None  # [B, V] float32: each token's count among the row's output
    allowed: torch.Tensor | None = None  # [B, ceil(V / 32)] int32 grammar masks, bit t: token t allowed

    def rows(self, n: int) -> "SamplerTensors":
        """Views of the first n rows (no copies)."""
        views = {f.name: getattr(self, f.name) for f in fields(self)}
        return SamplerTensors(**{name: None if v is None else v[:n] for name, v in views.items()})

    @classmethod
    def build(cls, rows: Sequence[RowSampling], vocab: int, device: torch.device,
              ban_width: int | None = None) -> "SamplerTensors":
        """Host rows -> device tensors in two transfers. `seen` (a [B, V] bool mask of `seen_ids`)
        only if some row has penalty != 1, else None; the output penalties' tensors only if some
        row has one; `ban_ids` padded with -1 to `ban_width` (default: the widest row, at least 1).
        `allowed` is not built here: grammar masks come from the caller."""
        if ban_width is None:
            ban_width = max(1, max((len(r.ban_ids) for r in rows), default=0))
        with_seen = any(r.penalty != 1.0 for r in rows)
        with_counts = any(r.frequency != 0.0 or r.presence != 0.0 for r in rows)
        return _Staged(rows, vocab, ban_width, with_seen, torch.device(device), with_counts).tensors()

    def write_rows(self, index: torch.Tensor | slice, rows: Sequence[RowSampling], vocab: int) -> None:
        """Write these rows' settings in place at `index` (e.g. a request joining a persistent
        decode batch); the tensors keep their addresses. If `seen` is kept, the rows' masks are
        reset and rebuilt from `seen_ids` (and `counts` from `output_ids`). `allowed` is left as it
        is. ValueError if a row has more ban ids than fit."""
        device = self.ban_ids.device
        staged = _Staged(rows, vocab, self.ban_ids.shape[1], self.seen is not None, device,
                         self.counts is not None).tensors()
        if isinstance(index, torch.Tensor):
            index = index.to(device)
        for f in fields(self):
            target = getattr(self, f.name)
            if target is not None and f.name != "allowed":
                target[index] = getattr(staged, f.name)


class _Staged:
    """Rows packed on the host into one float32 and one int64 array, each sent in one transfer.

    Built with numpy, not torch: torch's host kernels fan out to its OpenMP threads (its
    `repeat_interleave` for any two rows, a copy or `cat` past 32768 elements), which then spin
    on every core after each call; rows join a decode batch many times a second, and that spin
    took a large share of a captioning run's CPU time."""

    def __init__(self, rows: Sequence[RowSampling], vocab: int, ban_width: int, with_seen: bool,
                 device: torch.device, with_counts: bool = False):
        n = len(rows)
        self.n, self.vocab, self.ban_width = n, vocab, ban_width
        self.with_seen, self.with_counts, self.device = with_seen, with_counts, device
        self.floats = np.array([r.temperature for r in rows] + [r.top_p for r in rows]
                               + [r.min_p for r in rows] + [r.penalty for r in rows]
                               + ([r.frequency for r in rows] + [r.presence for r in rows] if with_counts else []),
                               dtype=np.float32)
        ints = ([r.top_k for r in rows] + [r.seed & _MASK32 for r in rows] + [r.step for r in rows]
                + [r.ban_until for r in rows])
        for i, r in enumerate(rows):  # ban_ids [n, ban_width], -1 = empty (as are ids no logit has)
            if len(r.ban_ids) > ban_width:
                raise ValueError(f"row {i} has {len(r.ban_ids)} banned token ids, more than the "
                                 f"{ban_width} columns of ban_ids")
            ints += [t if 0 <= t < vocab else -1 for t in r.ban_ids] + [-1] * (ban_width - len(r.ban_ids))
        parts = [np.array(ints, dtype=np.int64)]
        if with_seen:  # then the flat positions row * vocab + id of every seen id
            parts.append(_flat_positions([r.seen_ids for r in rows], vocab))
        self.seen_end = sum(len(p) for p in parts)
        if with_counts:  # then the flat positions of every generated id, once per occurrence
            parts.append(_flat_positions([r.output_ids for r in rows], vocab))
        self.ints = np.concatenate(parts)

    def tensors(self) -> SamplerTensors:
        n, width = self.n, self.ban_width
        floats, ints = to_device(self.floats, self.device), to_device(self.ints, self.device)
        seen = None
        if self.with_seen:
            seen = torch.zeros(n * self.vocab, dtype=torch.bool, device=self.device)
            seen.index_fill_(0, ints[(4 + width) * n:self.seen_end], True)  # not `seen[ids] = True`: that copies a CPU scalar and waits
            seen = seen.view(n, self.vocab)
        frequency = presence = counts = None
        if self.with_counts:
            frequency, presence = floats[4 * n:5 * n], floats[5 * n:6 * n]
            flat = ints[self.seen_end:]
            counts = torch.zeros(n * self.vocab, dtype=torch.float32, device=self.device)
            counts.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=self.device))
            counts = counts.view(n, self.vocab)  # whole counts in float32: exact in any order of addition
        return SamplerTensors(
            temperature=floats[:n], top_p=floats[n:2 * n], min_p=floats[2 * n:3 * n], penalty=floats[3 * n:4 * n],
            top_k=ints[:n], seeds=ints[n:2 * n], steps=ints[2 * n:3 * n], ban_until=ints[3 * n:4 * n],
            ban_ids=ints[4 * n:(4 + width) * n].view(n, width), seen=seen, frequency=frequency, presence=presence,
            counts=counts)


def _flat_positions(ids_per_row: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """row * vocab + id for every in-range id of every row (repeats kept)."""
    arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in ids_per_row]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    row = np.repeat(np.arange(len(arrays), dtype=np.int64), [len(x) for x in arrays])
    keep = (ids >= 0) & (ids < vocab)
    return row[keep] * vocab + ids[keep]


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    token_logprobs: torch.Tensor | None  # [B] float32, logprob of the chosen token
    top_ids: torch.Tensor | None  # [B, min(variant.logprobs, V)] int64, best first
    top_logprobs: torch.Tensor | None  # [B, min(variant.logprobs, V)] float32


def _hash32_(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit integer hash, in place on an int64 tensor of values < 2**32."""
    for _ in range(2):
        x ^= x >> 16
        x *= _HASH_MUL
        x &= _MASK32
    x ^= x >> 16
    return x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 uniforms in (0, 1), a pure function of (seed, step, column)."""
    base = _hash32_((_hash32_(seeds & _MASK32) + steps * 2 + 1) & _MASK32)
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64) * _GOLDEN
    x = base[:, None] + cols[None, :]
    x &= _MASK32
    _hash32_(x)
    x >>= 8  # 24 bits, exact in float32 (the + 0.5 rounds in float32, to 1.0 at the very top)
    return x.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))


def sample(logits: torch.Tensor, t: SamplerTensors | None, variant: SamplerVariant) -> SampleResult:
    """logits [B, V] -> chosen tokens and, if `variant.logprobs`, log-probabilities.

    Graph-safe: only `variant` (host booleans) and shapes choose code paths. `logits` is not
    modified. Rows with temperature 0 take the argmax of the penalised, banned logits. `t` may be
    None when `variant.needs_tensors` is false."""
    if t is None and variant.needs_tensors:
        raise ValueError(f"sample: {variant} needs SamplerTensors")
    vocab = logits.shape[-1]
    raw = logits.float()
    x, owned = raw, raw is not logits  # `owned`: x is our own copy, safe to modify in place
    if variant.penalty:
        if t.seen is None:
            raise ValueError("variant.penalty needs SamplerTensors.seen")
        p = t.penalty[:, None]
        x = torch.where(t.seen, torch.where(x > 0, x / p, x * p), x)  # transformers' rule
        owned = True
    if variant.output_penalty:
        if t.counts is None or t.frequency is None or t.presence is None:
            raise ValueError("variant.output_penalty needs SamplerTensors.counts, frequency and presence")
        # OpenAI's rule (as vLLM applies it, after the repetition penalty); 0 for rows without.
        x = x - t.frequency[:, None] * t.counts - t.presence[:, None] * (t.counts > 0).float()
        owned = True
    if variant.ban:
        x = _ban(x, t, owned)
        owned = True
    if variant.grammar:
        if t.allowed is None:
            raise ValueError("variant.grammar needs SamplerTensors.allowed")
        x = _allowed_only(x, t.allowed, owned)
        owned = True

    greedy = x.argmax(dim=-1)
    tokens = greedy
    if variant.random:
        # A row samples only when its temperature is positive (as SamplerVariant.of decides):
        # anything else is greedy, in any variant.
        tokens = torch.where(t.temperature > 0, _sample_random(x, t, variant), greedy)

    k = min(variant.logprobs, vocab)
    if k <= 0:
        return SampleResult(tokens, None, None, None)
    logprobs = torch.log_softmax(raw, dim=-1)
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return SampleResult(tokens, chosen, top_ids, top_lp)


def _ban(x: torch.Tensor, t: SamplerTensors, in_place: bool) -> torch.Tensor:
    """-inf on each row's ban_ids while steps < ban_until: a min-scatter of -inf, where empty (-1)
    entries and rows whose ban is over scatter +inf, a no-op (so the -1 padding, sent to column
    0, can never mark token 0, and a real ban of token 0 wins whatever the order)."""
    active = (t.ban_ids >= 0) & (t.steps < t.ban_until)[:, None]
    src = torch.where(active, float("-inf"), float("inf"))  # float32, like x
    index = t.ban_ids.clamp(min=0)
    if in_place:
        return x.scatter_reduce_(1, index, src, reduce="amin")
    return x.scatter_reduce(1, index, src, reduce="amin")


def _allowed_only(x: torch.Tensor, allowed: torch.Tensor, in_place: bool) -> torch.Tensor:
    """-inf on every token whose bit in the row's mask is clear (bit t of int32 word t // 32)."""
    cols = torch.arange(x.shape[-1], device=x.device)
    bits = (allowed.index_select(1, cols >> 5) >> (cols & 31).to(allowed.dtype)) & 1
    if in_place:
        return x.masked_fill_(bits == 0, float("-inf"))
    return x.masked_fill(bits == 0, float("-inf"))


def _sample_random(x: torch.Tensor, t: SamplerTensors, variant: SamplerVariant) -> torch.Tensor:
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0)  # greedy rows: exact x / 1
    x = x / temperature[:, None]
    if variant.top_k_top_p:
        x = _top_k_top_p(x, t.top_k, t.top_p)
    probs = torch.softmax(x, dim=-1)
    if variant.min_p:
        threshold = probs.amax(dim=-1, keepdim=True) * t.min_p[:, None]
        probs = probs.masked_fill_(probs < threshold, 0.0)  # min_p 0: nothing is < 0
    # The race argmax(p / E), E = -log(u) ~ Exp(1), computed as argmin(p / -E): the same bits
    # negated, so the same winner. E is 0 where u rounds to 1.0 (2**-24 of the draws: about 1% of
    # rows at a 152k vocabulary), and p / 0 is NaN for a token filtered out (p = 0), which argmax
    # would pick: -E is capped just below 0, so such a token never wins and one with p > 0 does.
    neg_exp = uniform_noise(t.seeds, t.steps, x.shape[-1]).log_().clamp_(max=-torch.finfo(torch.float32).tiny)
    return probs.div_(neg_exp).argmin(dim=-1)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the k best tokens, then (renormalised over those) the smallest prefix whose
    probability reaches p; done as a per-row logit threshold, so tokens tied with the last kept
    one are kept too. top_k 0 and top_p 1 keep every token (the threshold is the row's minimum)."""
    rows, vocab = x.shape
    ordered = x.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    ranks = torch.arange(vocab, device=x.device)
    probs = torch.softmax(ordered.masked_fill(ranks >= k[:, None], float("-inf")), dim=-1)
    if rows == 1:
        # CUDA's cumsum runs a single row through another kernel (cub), with another summation
        # order. Its per-row kernel sizes its blocks from the row count and length, which for a
        # vocabulary above 2**17 (Qwen's 151936) gives the same order at 2 to 512 rows: a single row is
        # scanned as two so that its top-p cutoff matches the one it gets in a batch.
        cumulative = probs.expand(2, vocab).contiguous().cumsum(dim=-1)[:1]
    else:
        cumulative = probs.cumsum(dim=-1)
    before = cumulative - probs  # mass strictly ahead of each token
    keep_p = (before < top_p[:, None]).sum(dim=-1)
    keep = torch.minimum(k, torch.where(top_p < 1.0, keep_p, vocab)).clamp(min=1)
    threshold = ordered.gather(1, (keep - 1)[:, None])
    return x.masked_fill_(x < threshold, float("-inf"))


def advance(t: SamplerTensors, tokens: torch.Tensor, variant: SamplerVariant,
            active: torch.Tensor | None = None) -> None:
    """After a decode step, on the device: steps += 1, (if variant.penalty) mark each row's sampled
    token in `seen`, (if variant.output_penalty) count it in `counts`. `active` [B] bool: only those rows advance (padded rows of a graph stay as they
    are). Graph-safe: no host sync."""
    if active is None:
        t.steps.add_(1)
    else:
        t.steps.add_(active.to(t.steps.dtype))
    if variant.penalty:
        if t.seen is None:
            raise ValueError("variant.penalty needs SamplerTensors.seen")
        index = tokens.to(torch.int64)[:, None]
        if active is None:
            t.seen.scatter_(1, index, True)
        else:  # inactive rows write back what they hold (one entry per row: no write conflicts)
            t.seen.scatter_(1, index, t.seen.gather(1, index) | active[:, None])
    if variant.output_penalty:
        if t.counts is None:
            raise ValueError("variant.output_penalty needs SamplerTensors.counts")
        index = tokens.to(torch.int64)[:, None]
        add = torch.ones_like(index, dtype=torch.float32) if active is None else active[:, None].float()
        t.counts.scatter_add_(1, index, add)  # one entry per row: no two rows add to one element
