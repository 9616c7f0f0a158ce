"""Decode steps over the persistent device batch (`language/decode_batch.py`), run eagerly or as
CUDA graphs with sampling inside.

Everything that advances every step (the fed token, lengths, positions, KV write slots, the
sampler's step counter and repetition mask) is computed on the device inside the step, so a
steady-state step is one replay and one device-to-host copy of the new tokens (and of
log-probabilities only when a request asked for them). `launch` queues that copy into pinned
memory and returns at once (`PendingDecode.get()` waits for it), so the engine can plan and
launch the next step first; since the rows advance on the device, each request's `seq_len` then
counts its token in flight.

The step (`DecodeGraphRunner.step_fn`; `body(key)` is its graph-runner form, see
`mmpipe.graphs.runner`) is embedding -> layers -> final norm -> LM head -> sampler -> advance.
It runs eagerly with exactly the batch's rows, or as the graph of the smallest bucket >= rows,
keyed by (bucket, sampler variant): the variant's host booleans choose which sampler stages exist
(greedy-only steps skip sorting and noise). Graphs of the start-up sampling's variants are
captured at start, largest bucket first, into one memory pool shared by every language-model
graph; other variants are captured the first time a batch needs them. Padded rows (size ..
bucket-1) are inactive: their K/V land in the reserved page and they never advance; their outputs
are ignored. Batches above the largest bucket, and any capture that fails, run eagerly.

Structured output: a step with a row constrained by a grammar runs in two parts, so the grammar's
host work overlaps the GPU. `launch` queues the forward (graph key (bucket, LOGITS): up to the
LM head, into a static logits buffer) and returns at once; the engine meanwhile reads the step
before's tokens, advances the grammars and fills the masks (`mask_rows`), and `finish` uploads them
and queues the sampler (graph key (bucket, variant): the sampler, the grammar's mask inside it,
and the advance). Constrained and free rows share both graphs; a free row's mask allows every token.

Graphs bake in the addresses of the batch's buffers, of the weights and of the KV cache: none of
them may be reallocated while the runner's graphs live.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from mmpipe.language.attention.metadata import AttentionMetadata
from mmpipe.language.decode_batch import DecodeBatch, DecodeSource, row_sampling
from mmpipe.language.host_tokens import HostTokens
from mmpipe.language.kv_cache import KVCache
from mmpipe.language.sampler import (
    SampleResult,
    SamplerTensors,
    SamplerVariant,
    advance,
    sample,
)

from mmpipe.config import GraphConfig
from mmpipe.graphs.cache import bucket_for
from mmpipe.graphs.memory import GraphMemory
from mmpipe.graphs.runner import GraphRunner, capturable
from mmpipe.graphs.transfer import to_device
from mmpipe.layers.context import ForwardContext, forward_context
from mmpipe.step_io import PendingDecode

log = logging.getLogger("mmpipe")
LOGITS = "logits"  # second half of the key of a constrained step's forward graph (its first: the bucket)


def default_decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, then steps of 16 to 256 (and on, steps of 32), capped by `max_batch`
    (which is always a bucket, so every allowed batch has a graph)."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, 257, 16))
    size = 288
    while size <= max_batch:
        sizes.append(size)
        size += 32
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def _variants(sampling: Any) -> list[SamplerVariant]:
    """The sampler variants a run of requests with these resolved settings uses: while a
    min_new_tokens ban holds, and after (one variant when they are the same)."""
    shim = types.SimpleNamespace(sampling=sampling, seed=0, output_ids=[], prompt_ids=[])
    row = row_sampling(shim)  # type: ignore[arg-type]
    return list(dict.fromkeys([SamplerVariant.of([row]), SamplerVariant.of([replace(row, step=row.ban_until)])]))


class DecodeGraphRunner(DecodeBatch, GraphRunner):
    """The persistent decode batch and its step, eager or captured. Model-agnostic: it needs the
    language model's `embed(ids)`, `forward(embeds, positions)` and `compute_logits(hidden)`."""

    def __init__(self, lm: Any, kv: KVCache, max_rows: int, max_model_len: int, device: torch.device,
                 graphs: GraphConfig | None = None, ban_width: int = 16,
                 memory: "GraphMemory | str | None" = None) -> None:
        DecodeBatch.__init__(self, lm, kv, max_rows, max_model_len, device, ban_width)
        # Graphs: keyed (bucket, sampler variant).
        graphs = graphs or GraphConfig(enabled=False)
        buckets = {min(int(b), max_rows) for b in graphs.buckets or default_decode_buckets(max_rows)}
        if isinstance(memory, str) or memory is None:  # else: a memory shared with the prefill graphs
            memory = memory or graphs.memory
        GraphRunner.__init__(self, "decode", device, buckets, graphs.enabled is not False, lm.attention, memory,
                         max(graphs.max_graphs, len(buckets)))
        self.buckets = sorted(buckets)
        self.startup_sampling: Any = None  # resolved sampling whose graphs start-up captures (None: greedy's)
        self._logits: torch.Tensor | None = None  # [max_rows, vocab] float32: constrained steps' logits
        self._masks_host: torch.Tensor | None = None  # pinned staging of the grammar masks
        self._masks_copied: torch.cuda.Event | None = None  # the staging's last upload
        self._awaiting: tuple[int, SamplerVariant, int | None, torch.Tensor, bool, PendingDecode] | None = None

    # ------------------------------------------------------------------ graphs

    def capture_sampling(self, sampling: Any, progress: bool = True) -> int:
        """Capture the buckets of the sampler variants a run of requests with these resolved
        settings uses (while a min_new_tokens ban holds, and after) that no live graph serves yet;
        returns the graphs captured."""
        if self.cache is None:
            return 0
        before = self.cache.stats.captures
        for variant in _variants(sampling):
            wanted = _keys(self.buckets, variant)
            serving = [self.lookup(key) for key in wanted]
            for live in filter(None, serving):
                self.cache.touch(live)  # kept ahead of other graphs while the missing ones are captured
            missing = [key for key, live in zip(wanted, serving) if live is None]
            if missing:  # only these: capturing a live key again would replace its graph
                super().capture_all(missing, progress, "batch sizes")
        return self.cache.stats.captures - before

    def startup_keys(self) -> list[Any]:
        """What start-up captures: every bucket, largest first, for the variants of
        `startup_sampling` (set by the model runner; None: greedy's)."""
        if self.cache is None:
            return []
        variants = _variants(self.startup_sampling) if self.startup_sampling is not None else [SamplerVariant()]
        return list(dict.fromkeys(key for v in variants for key in _keys(self.buckets, v)))

    def capture_all(self, variant: SamplerVariant = SamplerVariant(), progress: bool = True) -> None:  # type: ignore[override]
        """Capture every bucket for `variant`, largest first."""
        super().capture_all(_keys(self.buckets, variant), progress, "batch sizes")

    def capture_guard(self) -> Any:
        """The warm-up run inside a capture executes the step: with every row inactive, rows do not
        advance (the K/V it writes are the values the real step writes)."""
        return _rows_inactive(self.active)

    def body(self, key: Any) -> Callable[[], Any]:
        bucket, variant = key
        if variant == LOGITS:
            logits, forward = self._logits_buffer()[:bucket], self.forward_fn(bucket, None)
            return lambda: logits.copy_(forward())
        if variant.grammar:  # the sampler half of a constrained step, over the forward's logits
            logits, sample_step = self._logits_buffer()[:bucket], self.sample_fn(bucket, variant)
            return lambda: sample_step(logits)
        return self.step_fn(bucket, variant, None)

    def label(self, key: Any) -> str:
        return f"batch {key[0]} {'forward' if key[1] == LOGITS else variant_label(key[1])}"

    def lookup(self, key: Any) -> Any:
        """The exact variant's graph, else the live one with the fewest extra cheap stages that
        covers it (`covers`)."""
        assert self.cache is not None
        if key in self.cache:
            return key
        bucket, variant = key
        if variant == LOGITS:
            return None
        covering = [k for k in self.cache.live_keys()
                    if k[0] == bucket and k[1] != LOGITS and covers(k[1], variant)]
        return min(covering, key=lambda k: _stage_count(k[1])) if covering else None

    def _logits_buffer(self) -> torch.Tensor:
        if self._logits is None:  # made on the first constrained step: most runs have none
            self._logits = torch.empty(self.max_rows, self.vocab, dtype=torch.float32, device=self.device)
            if self.cache is not None and self.cache.max_graphs is not None:
                # Constrained steps take two graphs a bucket beside the free steps' one: room for
                # all three, so serving both kinds does not evict and recapture graphs by turns.
                self.cache.max_graphs = max(self.cache.max_graphs, 3 * len(self.buckets))
        return self._logits

    # ------------------------------------------------------------------ the step

    def step_fn(self, n: int, variant: SamplerVariant, host_lens: list[int] | None,
                split_rows: int | None = None) -> Callable[[], SampleResult]:
        """One decode step over rows 0..n-1 of the static buffers (captured, or run eagerly).
        `host_lens`: the rows' lengths for backends that need host values (eager only).
        `split_rows`: the batch size attention plans its splits for (the bucket; default n)."""
        forward, sample_step = self.forward_fn(n, host_lens, split_rows), self.sample_fn(n, variant)
        return lambda: sample_step(forward())

    def forward_fn(self, n: int, host_lens: list[int] | None, split_rows: int | None = None
                   ) -> Callable[[], torch.Tensor]:
        """The step's forward over rows 0..n-1, up to the logits [n, vocab] float32."""
        lm, ps = self.lm, self.page_size
        ids, lens, delta = self.input_ids[:n], self.seq_lens[:n], self.mrope_delta[:n]
        table = self.page_table[:n]

        def run() -> torch.Tensor:
            last = (lens - 1).long()  # index of the token fed this step
            slots = table.gather(1, (last // ps).unsqueeze(1)).squeeze(1).long() * ps + last % ps
            meta = AttentionMetadata(
                is_decode=True, num_tokens=n, slot_mapping=slots, seq_lens=lens, query_start_loc=None,
                page_table=table, seq_lens_host=host_lens, query_lens_host=[1] * n if host_lens else None,
                max_query_len=1, max_seq_len=max(host_lens) if host_lens else None,
                seq_len_bound=self.max_model_len, split_rows=split_rows or n)
            positions = (last + delta).unsqueeze(0).expand(3, n)
            with forward_context(ForwardContext(meta, self.kv.layers, lm.attention)):
                hidden = lm(lm.embed(ids), positions, self.kv.layers, slots)
            return lm.compute_logits(hidden)

        return run

    def sample_fn(self, n: int, variant: SamplerVariant) -> Callable[[torch.Tensor], SampleResult]:
        """The step's sampler over rows 0..n-1 of these logits, then the rows' advance."""
        if variant.output_penalty:  # a graph captured before any row used them still needs them
            self._output_penalty_buffers()
        ids, lens, active, sampler = self.input_ids[:n], self.seq_lens[:n], self.active[:n], self.sampler.rows(n)

        def run(logits: torch.Tensor) -> SampleResult:
            result = sample(logits, sampler, variant)
            # Advance active rows for the next step, on the device.
            ids.copy_(torch.where(active, result.tokens, ids))
            lens.add_(active.to(lens.dtype))
            advance(sampler, result.tokens, variant, active)
            return result

        return run

    @torch.inference_mode()
    def launch(self, requests: Sequence[DecodeSource]) -> "PendingDecode":
        """Queue one decode step for `requests` and the copy of its tokens to the host, without
        waiting for the GPU. The rows advance on the device, so the next step may be launched
        before this one's tokens are read (each request's `seq_len` then counts its token in
        flight)."""
        start = time.perf_counter()
        try:
            rows = self._sync(requests)
        except BaseException:
            self.reset()
            raise
        n = self.size
        variant = self._variant(n)
        bucket = self.size_for(n)
        if self.enabled and bucket is None:
            self.fallback("decode batch of %d rows runs eagerly (largest graph bucket %d)", n, self.buckets[-1])

        # Host lengths only for a backend that needs them (the reference; CUDA reads the device).
        host_lens = None if capturable(self.lm.attention) else (self.lens[:n] + 1).tolist()
        split_rows = bucket_for(self.buckets, n) or n
        try:
            if variant.grammar:  # the forward now, the sampler once the masks are in (`finish`)
                logits, in_graph = self.run(None if bucket is None else (bucket, LOGITS),
                                            self.forward_fn(n, host_lens, split_rows))
                pending = PendingDecode(None, rows)
                self._awaiting = (n, variant, bucket, logits, in_graph, pending)
            else:
                result, _ = self.run(None if bucket is None else (bucket, variant),
                                     self.step_fn(n, variant, host_lens, split_rows))
                pending = PendingDecode(HostTokens(result, n, variant.logprobs > 0), rows)
        except BaseException:
            self.reset()
            raise
        self.host_seconds += time.perf_counter() - start
        self.lens[:n] += 1
        self.steps[:n] += 1
        return pending

    @property
    def awaiting_masks(self) -> bool:
        """A constrained step's forward is queued and its sampler waits for `finish`."""
        return self._awaiting is not None

    def mask_rows(self) -> np.ndarray:
        """The waiting step's grammar masks on the host, [rows, ceil(vocab / 32)] int32, every bit
        set (free rows); the caller writes the constrained rows' masks, then calls `finish`."""
        if self._awaiting is None:
            raise RuntimeError("no constrained decode step is waiting for its masks")
        n, width = self._awaiting[0], self.sampler.allowed.shape[1]  # type: ignore[union-attr]
        if self._masks_host is None:
            self._masks_host = torch.empty(self.max_rows, width, dtype=torch.int32,
                                           pin_memory=self.device.type == "cuda")
        if self._masks_copied is not None:
            self._masks_copied.synchronize()  # the last upload has read the staging
        masks = self._masks_host[:n].numpy()
        masks.fill(-1)
        return masks

    @torch.inference_mode()
    def finish(self, masks: np.ndarray | None = None) -> None:
        """Upload the waiting step's masks (default: what `mask_rows` returned, filled in) and
        queue its sampler; its `PendingDecode` then has its tokens on the way to the host."""
        if self._awaiting is None:
            raise RuntimeError("no constrained decode step is waiting for its masks")
        n, variant, bucket, logits, in_graph, pending = self._awaiting
        self._awaiting = None
        start = time.perf_counter()
        try:
            staged = self._masks_host[:n] if masks is None else torch.from_numpy(masks)  # type: ignore[index]
            allowed = self.sampler.allowed[:n]  # type: ignore[index]
            allowed.copy_(staged, non_blocking=staged.is_pinned())
            if self.device.type == "cuda" and staged.is_pinned():
                self._masks_copied = torch.cuda.Event()
                self._masks_copied.record(torch.cuda.current_stream(self.device))
            # The sampler graph reads the forward graph's logits buffer: a forward run eagerly
            # (no graph fits, or its capture failed) samples eagerly too.
            eager = lambda: self.sample_fn(n, variant)(logits[:n])
            result, _ = self.run((bucket, variant) if in_graph and bucket is not None else None, eager)
            pending.tokens = HostTokens(result, n, variant.logprobs > 0)
        except BaseException:
            self.reset()
            raise
        self.host_seconds += time.perf_counter() - start

    @torch.inference_mode()
    def sample_logits(self, requests: Sequence[DecodeSource], logits: torch.Tensor,
                      masks: np.ndarray | None = None) -> PendingDecode:
        """Queue sampling of one token per request from prefill logits, without waiting for it.
        `masks`: the rows' grammar masks ([rows, ceil(vocab / 32)] int32), when some row has one."""
        rows = [row_sampling(r) for r in requests]
        variant = SamplerVariant.of(rows)
        if variant.grammar and masks is None:
            raise ValueError("sample_logits: a row constrained by a grammar needs its mask")
        # Greedy rows need no per-row tensors: no transfers between the logits and the argmax.
        tensors = SamplerTensors.build(rows, logits.shape[-1], self.device) if variant.needs_tensors else None
        if variant.grammar:
            tensors.allowed = to_device(masks, self.device)  # type: ignore[union-attr]
        result = sample(logits, tensors, variant)
        return PendingDecode(HostTokens(result, len(requests), variant.logprobs > 0),
                             np.arange(len(requests), dtype=np.int64))

    def reset(self) -> None:
        """Forget every row, and a constrained step waiting for its masks."""
        self._awaiting = None
        super().reset()

    def detail(self) -> dict[str, Any]:
        return dict(self.batch_stats.__dict__)


@contextlib.contextmanager
def _rows_inactive(active: torch.Tensor) -> Iterator[None]:
    saved = active.clone()
    active.zero_()
    try:
        yield
    finally:
        active.copy_(saved)


def _keys(buckets: Sequence[int], variant: SamplerVariant) -> list[tuple[int, Any]]:
    """The graph keys a variant's steps use, largest bucket first: one step graph per bucket, or
    for a constrained variant the forward's and the sampler's."""
    largest_first = sorted(buckets, reverse=True)
    if variant.grammar:
        return [(b, LOGITS) for b in largest_first] + [(b, variant) for b in largest_first]
    return [(b, variant) for b in largest_first]


def covers(have: SamplerVariant, need: SamplerVariant) -> bool:
    """Whether a graph captured for `have` serves rows that need `need` with the same results and
    about the same cost: only the cheap stages (penalty, ban, min-p) may be extra, since a stage a
    row does not use leaves it bit for bit as it was. Sampling noise and the top-k/top-p sort cost
    passes over the whole vocabulary, and a larger top-logprob count may break ties among equal
    logits in another order, so those must match exactly."""
    if (have.random, have.top_k_top_p, have.logprobs, have.grammar) != (
            need.random, need.top_k_top_p, need.logprobs, need.grammar):
        return False  # a grammar's sampler is a graph of its own (the forward is another)
    return all(getattr(have, s) or not getattr(need, s) for s in ("penalty", "ban", "min_p", "output_penalty"))


def _stage_count(variant: SamplerVariant) -> int:
    return sum(map(bool, (variant.random, variant.top_k_top_p, variant.min_p, variant.penalty, variant.ban,
                          variant.logprobs, variant.output_penalty, variant.grammar)))


def variant_label(variant: SamplerVariant) -> str:
    on = [name for name in ("random", "top_k_top_p", "min_p", "penalty", "ban", "output_penalty", "grammar")
          if getattr(variant, name)]
    if variant.logprobs:
        on.append(f"logprobs={variant.logprobs}")
    return "greedy" if not on else "+".join(on)
