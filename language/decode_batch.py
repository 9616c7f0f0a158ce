"""The decode batch kept on the device: static per-row buffers (token ids, lengths, M-RoPE deltas,
page tables, sampling settings, an `active` flag) allocated once for `max_rows` rows, and their
host mirrors.

Rows are dense (0 .. size-1) and a request keeps its row for as long as it keeps decoding, so a
step changes the device state only where something changed: a request joined (its row is
written), left (the last row moves into the hole, rows past the end are reset to padding) or
gained a KV page (one entry of its page-table row). What advances every step is advanced on the
device by the step itself (`DecodeGraphRunner.step_fn`), so a steady-state step uploads nothing.
Padding rows are inactive: length 1 on the dummy page, neutral sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from mmpipe.language.kv_cache import DUMMY_PAGE, KVCache
from mmpipe.language.sampler import RowSampling, SamplerTensors, SamplerVariant, logprobs_bucket

from mmpipe.graphs.transfer import to_device

# Per-row feature bits, OR-reduced over the batch into the sampler variant.
_RANDOM, _TOP_K_P, _MIN_P, _PENALTY, _OUTPUT_PENALTY, _GRAMMAR = 1, 2, 4, 8, 16, 32


class DecodeSource(Protocol):
    """What a decode row needs from a request (the engine's Request has these)."""

    prompt_ids: list[int]
    output_ids: list[int]  # the last one is fed this step (when none is in flight)
    mrope_delta: int
    pages: list[int]
    sampling: Any  # ResolvedSampling (`json_schema` set: its tokens are masked by a grammar)
    seed: int

    @property
    def total_len(self) -> int: ...  # prompt + tokens on the host

    @property
    def seq_len(self) -> int: ...  # total_len + tokens still in flight from launched steps



@dataclass
class DecodeBatchStats:
    rows_written: int = 0
    rows_moved: int = 0
    pages_appended: int = 0


def row_sampling(request: "DecodeSource") -> RowSampling:
    """A request's sampling settings as one sampler row, as of its next token."""
    s = request.sampling
    ban = tuple(sorted(set(s.stop_token_ids) | set(s.eos_token_ids))) if s.min_new_tokens > 0 else ()
    output_penalty = s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
    return RowSampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                       penalty=s.repetition_penalty, seed=request.seed, step=len(request.output_ids), ban_ids=ban,
                       ban_until=s.min_new_tokens if ban else 0,
                       seen_ids=request.prompt_ids + request.output_ids if s.repetition_penalty != 1.0 else (),
                       logprobs=s.logprobs, frequency=s.frequency_penalty, presence=s.presence_penalty,
                       output_ids=request.output_ids if output_penalty else (),
                       grammar=s.json_schema is not None)


class DecodeBatch:
    """The persistent rows and their bookkeeping; `DecodeGraphRunner` runs the step over them."""

    def __init__(self, lm: Any, kv: KVCache, max_rows: int, max_model_len: int, device: torch.device,
                 ban_width: int = 16) -> None:
        self.lm, self.kv, self.device = lm, kv, device
        self.max_rows, self.page_size = max_rows, kv.page_size
        self.max_pages = -(-max_model_len // kv.page_size)
        self.max_model_len = max_model_len
        self.vocab = lm.vocab_size
        rows = max_rows
        # Static buffers (outside any graph memory; graphs read slices of them).
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.mrope_delta = torch.zeros(rows, dtype=torch.int64, device=device)
        self.page_table = torch.full((rows, self.max_pages), DUMMY_PAGE, dtype=torch.int32, device=device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.sampler = SamplerTensors(
            temperature=torch.zeros(rows, dtype=torch.float32, device=device),
            top_k=torch.zeros(rows, dtype=torch.int64, device=device),
            top_p=torch.ones(rows, dtype=torch.float32, device=device),
            min_p=torch.zeros(rows, dtype=torch.float32, device=device),
            penalty=torch.ones(rows, dtype=torch.float32, device=device),
            seeds=torch.zeros(rows, dtype=torch.int64, device=device),
            steps=torch.zeros(rows, dtype=torch.int64, device=device),
            ban_ids=torch.full((rows, ban_width), -1, dtype=torch.int64, device=device),
            ban_until=torch.zeros(rows, dtype=torch.int64, device=device),
            seen=torch.zeros(rows, self.vocab, dtype=torch.bool, device=device),
            # Grammar masks: written whole before each step that has a constrained row.
            allowed=torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32, device=device),
        )  # frequency, presence and counts: allocated when a row first uses them (`_output_penalty_buffers`)
        self.ban_width = ban_width
        # Host mirrors of what the device holds per row.
        self.requests: list[DecodeSource | None] = [None] * rows
        self.row_of: dict[int, int] = {}
        self.size = 0
        self.lens = np.zeros(rows, dtype=np.int64)  # sequence length the row's last step used
        self.pages_written = np.zeros(rows, dtype=np.int64)
        self.steps = np.zeros(rows, dtype=np.int64)
        self.ban_until = np.zeros(rows, dtype=np.int64)
        self.flags = np.zeros(rows, dtype=np.int64)
        self.logprobs = np.zeros(rows, dtype=np.int64)
        self.batch_stats = DecodeBatchStats()
        self.host_seconds = 0.0
        self._last_order: list[int] | None = None  # request ids of the last step, in order
        self._last_rows = np.zeros(0, dtype=np.int64)

    def _sync(self, requests: Sequence[DecodeSource]) -> np.ndarray:
        """Bring the device rows in line with `requests`; returns each request's row."""
        order = [id(r) for r in requests]
        if order == self._last_order:  # the steady state: same requests, same rows, one token on
            rows = self._last_rows
            totals = np.fromiter((r.seq_len for r in requests), dtype=np.int64, count=len(requests))
            if np.array_equal(totals, self.lens[rows] + 1):
                self._grow_pages(requests, rows, totals)
                return rows
        rows = self._sync_rows(requests)
        self._last_order, self._last_rows = order, rows
        return rows

    def _grow_pages(self, requests: Sequence[DecodeSource], rows: np.ndarray, totals: np.ndarray) -> None:
        need = -(-totals // self.page_size)
        have = self.pages_written[rows]
        grown = np.nonzero(need > have)[0]
        if not grown.size:
            return
        appends = [(int(rows[i]), col, requests[i].pages[col]) for i in grown.tolist()
                   for col in range(int(have[i]), int(need[i]))]
        self.pages_written[rows[grown]] = need[grown]
        self._append_pages(appends)

    def _sync_rows(self, requests: Sequence[DecodeSource]) -> np.ndarray:
        """The general case of `_sync`: joins, leaves, moves."""
        wanted = {id(r) for r in requests}
        if len(wanted) != len(requests):
            raise ValueError("a request appears twice in one decode batch")
        if len(requests) > self.max_rows:
            raise ValueError(f"{len(requests)} requests exceed the decode batch's {self.max_rows} rows")
        old_size, target = self.size, len(requests)
        lens = self.lens.tolist()  # plain ints: this loop runs for every row of every step
        # Rows whose request left, or went out of step with its row (recomputed), are freed.
        for row in range(old_size):
            request = self.requests[row]
            if request is not None and (id(request) not in wanted or request.seq_len != lens[row] + 1):
                self._forget(row)
        # Rows stay dense: requests sitting past the new end move into holes, newcomers take the rest.
        holes = [row for row in range(target) if self.requests[row] is None]
        movers = [row for row in range(target, old_size) if self.requests[row] is not None]
        moves = list(zip(movers, holes))
        for src, dst in moves:
            self._move_host(src, dst)
        fresh = holes[len(movers):]
        new = [r for r in requests if id(r) not in self.row_of]
        for row, request in zip(fresh, new):
            self._adopt(row, request)
        self.size = target
        if moves:
            self._move_device(moves)
        if fresh:
            self._write_rows(fresh)
        if old_size > target:
            self._reset_rows(range(target, old_size))
        # Pages gained by rows that stayed (fresh rows were written whole).
        rows = np.asarray([self.row_of[id(request)] for request in requests], dtype=np.int64)
        totals = np.fromiter((r.seq_len for r in requests), dtype=np.int64, count=len(requests))
        self._grow_pages(requests, rows, totals)
        return rows

    def release(self, requests: Sequence[DecodeSource]) -> None:
        """Drop finished requests' rows now (the device rows are reused at the next step)."""
        for request in requests:
            row = self.row_of.get(id(request))
            if row is not None:
                self._forget(row)

    def _forget(self, row: int) -> None:
        self._last_order = None
        request = self.requests[row]
        self.row_of.pop(id(request), None)
        self.requests[row] = None

    def _adopt(self, row: int, request: DecodeSource) -> None:
        self.requests[row] = request
        self.row_of[id(request)] = row

    def _move_host(self, src: int, dst: int) -> None:
        request = self.requests[src]
        self.requests[dst], self.requests[src] = request, None
        self.row_of[id(request)] = dst
        for mirror in (self.lens, self.pages_written, self.steps, self.ban_until, self.flags, self.logprobs):
            mirror[dst] = mirror[src]

    def _move_device(self, moves: list[tuple[int, int]]) -> None:
        src = to_device(np.asarray([s for s, _ in moves], dtype=np.int64), self.device)
        dst = to_device(np.asarray([d for _, d in moves], dtype=np.int64), self.device)
        for buffer in self._row_buffers():
            buffer.index_copy_(0, dst, buffer.index_select(0, src))
        self.batch_stats.rows_moved += len(moves)

    def _row_buffers(self) -> list[torch.Tensor]:
        s = self.sampler
        buffers = [self.input_ids, self.seq_lens, self.mrope_delta, self.page_table, self.active, s.temperature,
                   s.top_k, s.top_p, s.min_p, s.penalty, s.seeds, s.steps, s.ban_ids, s.ban_until]
        optional = [s.seen, s.frequency, s.presence, s.counts]
        return buffers + [b for b in optional if b is not None]

    def _output_penalty_buffers(self) -> None:
        """The frequency and presence penalties' per-row buffers ([rows, vocab] counts), made when a
        row first uses them: most runs never do. Graphs captured before never read them."""
        if self.sampler.counts is None:
            rows, device = self.max_rows, self.device
            self.sampler.frequency = torch.zeros(rows, dtype=torch.float32, device=device)
            self.sampler.presence = torch.zeros(rows, dtype=torch.float32, device=device)
            self.sampler.counts = torch.zeros(rows, self.vocab, dtype=torch.float32, device=device)

    def _write_rows(self, rows: list[int]) -> None:
        """Upload whole rows for requests that just joined."""
        ps = self.page_size
        count = len(rows)
        table = np.full((count, self.max_pages), DUMMY_PAGE, dtype=np.int32)
        scalars = np.empty((3, count), dtype=np.int64)  # token, length, delta
        settings: list[RowSampling] = []
        for i, row in enumerate(rows):
            request = self.requests[row]
            assert request is not None
            if request.seq_len != request.total_len:
                raise RuntimeError("a request joined the decode batch while its newest token is still in flight")
            length = request.total_len
            if length > self.max_model_len:
                raise ValueError(f"sequence of {length} tokens exceeds max_model_len {self.max_model_len}")
            pages = -(-length // ps)
            table[i, :pages] = request.pages[:pages]
            scalars[:, i] = (request.output_ids[-1], length, request.mrope_delta)
            setting = row_sampling(request)
            if len(setting.ban_ids) > self.ban_width:
                raise ValueError(f"a request bans {len(setting.ban_ids)} token ids before min_new_tokens; "
                                 f"at most {self.ban_width} (EngineConfig.max_banned_tokens)")
            settings.append(setting)
            self.lens[row] = length - 1  # the step adds the fed token
            self.pages_written[row] = pages
            self.steps[row] = setting.step
            self.ban_until[row] = setting.ban_until if setting.ban_ids else 0
            self.flags[row] = _row_flags(setting)
            self.logprobs[row] = setting.logprobs
        index = to_device(np.asarray(rows, dtype=np.int64), self.device)
        host = to_device(scalars, self.device)
        self.input_ids.index_copy_(0, index, host[0])
        self.seq_lens.index_copy_(0, index, host[1].to(torch.int32))
        self.mrope_delta.index_copy_(0, index, host[2])
        self.page_table.index_copy_(0, index, to_device(table, self.device))
        self.active.index_fill_(0, index, True)
        if any(s.frequency != 0.0 or s.presence != 0.0 for s in settings):
            self._output_penalty_buffers()
        self.sampler.write_rows(index, settings, self.vocab)
        self.batch_stats.rows_written += count

    def _reset_rows(self, rows: range) -> None:
        """Padding state: inactive, length 1 on the dummy page, neutral sampling."""
        s = slice(rows.start, rows.stop)
        self.active[s] = False
        self.seq_lens[s] = 1
        self.page_table[s] = DUMMY_PAGE
        self.input_ids[s] = 0
        index = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=self.device)
        self.sampler.write_rows(index, [RowSampling()] * len(rows), self.vocab)
        for mirror in (self.lens, self.pages_written, self.steps, self.ban_until, self.flags, self.logprobs):
            mirror[s] = 0
        for row in rows:
            if self.requests[row] is not None:
                self._forget(row)

    def _append_pages(self, appends: list[tuple[int, int, int]]) -> None:
        triples = to_device(np.asarray(appends, dtype=np.int64).T, self.device)
        self.page_table.index_put_((triples[0], triples[1]), triples[2].to(torch.int32))
        self.batch_stats.pages_appended += len(appends)

    def _variant(self, n: int) -> SamplerVariant:
        flags = int(np.bitwise_or.reduce(self.flags[:n])) if n else 0
        return SamplerVariant(random=bool(flags & _RANDOM), top_k_top_p=bool(flags & _TOP_K_P),
                              min_p=bool(flags & _MIN_P), penalty=bool(flags & _PENALTY),
                              ban=bool(np.any(self.ban_until[:n] > self.steps[:n])),
                              logprobs=logprobs_bucket(int(self.logprobs[:n].max(initial=0))),
                              output_penalty=bool(flags & _OUTPUT_PENALTY), grammar=bool(flags & _GRAMMAR))

    def reset(self) -> None:
        """Forget every row (after a failed step the device state is not trusted)."""
        self._last_order = None
        self._reset_rows(range(0, self.max_rows))
        self.size = 0
        self.row_of.clear()


def _row_flags(s: RowSampling) -> int:
    flags = 0
    if s.temperature > 0:
        flags |= _RANDOM
        if s.top_k > 0 or s.top_p < 1.0:
            flags |= _TOP_K_P
        if s.min_p > 0:
            flags |= _MIN_P
    if s.penalty != 1.0:
        flags |= _PENALTY
    if s.frequency != 0.0 or s.presence != 0.0:
        flags |= _OUTPUT_PENALTY
    if s.grammar:
        flags |= _GRAMMAR
    return flags
