"""Continuous batching: which requests run in the next step, and how much of each.

Each step has a decode batch (every running request whose prompt is done, one token each, up
to `max_running_requests`) and a prefill batch (prompt chunks packed up to `max_prefill_tokens`),
so a long prompt advances a chunk per step while decoding continues. Images overlapping the
scheduled chunks are encoded in the same step, bounded by `max_vision_patches`; a chunk stops
before an image that would overflow that budget.

KV pages: admission reserves pages for the request's whole current sequence (prompt, plus
tokens already generated if it is being recomputed), so a half-prefilled request never waits
for pages. Decoding grows a request one page at a time; when no page is free the newest running
request is preempted: its pages are freed, it goes back to the front of the waiting queue, and
it is recomputed from its prompt and the tokens it had generated, so nothing is lost or
duplicated. Finished and aborted requests free their pages at once.

Prefix caching (`EngineConfig.prefix_caching`): admission looks up the request's leading full
pages in the cache (`prefix_keys`), holds those found and starts its prefill after them (never
at its last token, whose logits it needs); pages it computes itself are registered once full
(`cache_computed`, after each launch, and when its pages are released), so a preempted,
finished or aborted request leaves its pages cached. After a failed step the pages its requests
registered are forgotten (the engine empties the cache) and their other pages are never
registered (`stop_caching`): their contents are in doubt. A new request whose every full page is
cached and whose whole prompt was prefilled before takes its first token from the logits kept
then (`first_token_cache`): it is admitted with no prompt chunk, and its remaining prompt tokens
are computed in its next step together with that token.

Overlapped scheduling (the engine plans step N+1 before step N's tokens reach the host): a
request's token in flight (`Request.pending`) counts in its length. A decoding request is
planned again at once, since its decode row feeds that token on the device; a request whose
first token comes from its prefill joins the decode batch once the token is on the host; a
preempted request is readmitted only when its token in flight has arrived. Freeing pages that
the in-flight step still writes is safe: every later use of them is queued after it on the
same stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mmpipe.config import EngineConfig
from mmpipe.engine.batch import PrefillChunk
from mmpipe.engine.encoder_cache import EncoderCache
from mmpipe.engine.first_token_cache import FirstTokenCache
from mmpipe.engine.key_memo import KeyMemo
from mmpipe.engine.kv_pages import PageAllocator, pages_needed
from mmpipe.engine.prefix_keys import extend_keys, prompt_key
from mmpipe.engine.request import Request

KEYS_AT_ONCE = 64  # prefix-cache keys hashed per batch at admission


@dataclass
class PrefixStats:
    """First admissions: how many, how many found cached pages, their prompt tokens, how many of
    those came from the cache; and first tokens read that were sampled from kept logits (a prompt
    within its first page has none to find, so these are not a part of the hits)."""

    requests: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        share = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"requests": self.requests, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "cached_share": share, "first_tokens": self.first_tokens}


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    images: list[tuple[Request, int]] = field(default_factory=list)  # embeddings to provide first
    preempted: list[Request] = field(default_factory=list)
    first_tokens: list[tuple[Request, torch.Tensor]] = field(default_factory=list)  # sampled from kept logits

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.first_tokens)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pages: PageAllocator, page_size: int, cache: EncoderCache) -> None:
        self.cfg, self.pages, self.page_size, self.cache = cfg, pages, page_size, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.prefix = PrefixStats()
        self.prefix_caching = cfg.prefix_caching  # switchable between steps (a benchmark compares both)
        self.first_tokens = FirstTokenCache()
        self.key_memo = KeyMemo()
        self._watermark = max(1, pages.capacity // 100)  # headroom so new admissions do not evict at once

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Release a finished request's pages and forget it (it may be waiting: a preempted
        request whose token in flight finished it)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self.key_memo.finished(request, self.page_size)

    def abort(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        self.finish(request)
        request.finish("abort")

    def requeue(self, requests: list[Request]) -> None:
        """Return running requests to the front of the queue, to be recomputed (after a failed step)."""
        plan = StepPlan()
        for request in reversed(requests):
            if request in self.running and not request.finished:
                self._preempt(request, plan)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        prefilling = self._schedule_decodes(plan)
        prefill_budget = self.cfg.max_prefill_tokens
        vision_budget = [self.cfg.max_vision_patches]
        for request in prefilling:
            if prefill_budget <= 0:
                break
            prefill_budget -= self._add_chunk(plan, request, prefill_budget, vision_budget)
        while self.waiting and prefill_budget > 0 and len(self.running) < self.cfg.max_running_requests:
            request = self.waiting[0]
            if request.pending or not self._admit(request):  # pending: recompute once its token is in
                break
            self.waiting.popleft()
            self.running.append(request)
            request.mark_scheduled()
            logits = self._kept_first_logits(request)
            # The first token's K/V are computed with the next step's chunk, if one follows it.
            if logits is not None and self._grow(request, request.prompt_len + (request.sampling.max_new_tokens > 1)):
                plan.first_tokens.append((request, logits))
            else:
                prefill_budget -= self._add_chunk(plan, request, prefill_budget, vision_budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan) -> list[Request]:
        """Plan a token for every decode-ready request (growing its pages, preempting the newest
        requests when none are free); returns the running requests still prefilling, in order."""
        preempted_before = len(plan.preempted)
        ready: list[Request] = []
        prefilling: list[Request] = []
        for request in self.running:  # one pass: hundreds of requests run at once
            if _decode_ready(request):
                ready.append(request)
            elif not request.pending:  # else its prompt is done and its first token is in flight
                prefilling.append(request)
        for request in ready:
            # Preempted to make room for an older request? (A list scan only after a preemption:
            # with hundreds of running requests a scan per request would cost milliseconds.)
            if len(plan.preempted) > preempted_before and any(p is request for p in plan.preempted):
                continue
            while not self._grow(request, request.seq_len):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                plan.decode.append(request)
        if len(plan.preempted) > preempted_before:
            prefilling = [r for r in prefilling if not any(p is r for p in plan.preempted)]
        return prefilling

    def _add_chunk(self, plan: StepPlan, request: Request, budget: int, vision_budget: list[int]) -> int:
        """Plan the next prompt chunk of `request`; returns the tokens it uses."""
        start = request.num_computed
        end = min(request.total_len, start + budget)
        for index, (first, image) in enumerate(zip(request.image_starts, request.images)):
            if first + image.num_tokens <= start or first >= end or request.image_embeds[index] is not None:
                continue
            if (request, index) in plan.images:
                continue
            cost = 0 if image.key in self.cache else image.num_patches
            if cost > vision_budget[0] and vision_budget[0] < self.cfg.max_vision_patches:
                end = first  # this image waits for the next step's vision batch
                break
            vision_budget[0] -= cost
            plan.images.append((request, index))
        if end <= start:
            return 0
        plan.prefill.append(PrefillChunk(request, start, end))
        return end - start

    # ------------------------------------------------------------------ pages

    def _admit(self, request: Request) -> bool:
        need = pages_needed(request.total_len, self.page_size)
        found = self._cached_prefix(request) if self.prefix_caching else []
        reclaimed = self.pages.unheld(found)  # counted free until held
        headroom = self._watermark if self.running else 0
        if need - len(found) + headroom > self.pages.num_free - reclaimed:
            return False
        self.pages.hold(found)
        request.pages = found + self.pages.allocate(need - len(found))
        request.num_computed = len(found) * self.page_size
        request.pages_cached = len(found)
        if request.first_scheduled is None:
            request.num_cached_tokens = request.num_computed
            self.prefix.requests += 1
            self.prefix.hits += bool(found)
            self.prefix.prompt_tokens += request.prompt_len
            self.prefix.cached_tokens += request.num_computed
        return True

    def _kept_first_logits(self, request: Request) -> torch.Tensor | None:
        """Logits for a just admitted new request's first token, kept when its prompt was
        prefilled before, if every full page before its last token was found cached."""
        if not self.prefix_caching or request.output_ids or request.pending:
            return None
        if request.num_computed != self._prompt_pages(request) * self.page_size:
            return None
        return self.first_tokens.get(prompt_key(request, self._prompt_pages(request), self.page_size))

    def keep_first_logits(self, requests: Sequence[Request], logits: torch.Tensor) -> None:
        """Keep the logits of prompts a prefill just completed (row i is requests[i]'s), under
        each prompt's key, for a later identical request (`_kept_first_logits`)."""
        if not self.prefix_caching:
            return
        for i, request in enumerate(requests):
            if not request.output_ids and not request.pending:  # the prompt's own last position
                self.first_tokens.keep(prompt_key(request, self._prompt_pages(request), self.page_size), logits[i:i + 1])

    def _prompt_pages(self, request: Request) -> int:
        """Full pages before the prompt's last token: what a prompt key chains before its tail."""
        return (request.prompt_len - 1) // self.page_size

    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached pages the request's sequence starts with, short of its last token."""
        found: list[int] = []
        limit = (request.total_len - 1) // self.page_size  # it may hold keys past it (a token dropped)
        self.key_memo.seed(request, limit, self.page_size)
        for start in range(0, limit, KEYS_AT_ONCE):  # keys in batches: a miss stops the hashing early
            end = min(limit, start + KEYS_AT_ONCE)
            found += self.pages.find(extend_keys(request, end, self.page_size)[start:end])
            if len(found) < end:
                break
        return found

    def cache_computed(self, requests: list[Request]) -> None:
        """Register the requests' pages that are full and computed (their tokens known on the host)."""
        if not self.prefix_caching:
            return
        size = self.page_size
        for request in requests:
            full = min(request.num_computed, request.total_len) // size
            if full <= request.pages_cached or not request.pages:
                continue
            keys = extend_keys(request, full, size)
            for index in range(request.pages_cached, full):
                self.pages.register(request.pages[index], keys[index])
            request.pages_cached = full

    def stop_caching(self, requests: list[Request]) -> None:
        """After a failed step: register none of the pages these requests hold (their contents are
        in doubt; the engine empties the cache of those already registered)."""
        for request in requests:
            request.pages_cached = len(request.pages)

    def _grow(self, request: Request, tokens: int) -> bool:
        """Make the request's pages cover `tokens` tokens."""
        missing = pages_needed(tokens, self.page_size) - len(request.pages)
        if missing <= 0:
            return True
        if missing > self.pages.num_free:
            return False
        request.pages += self.pages.allocate(missing)
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed = 0
        request.pending_decode = False  # its row is gone: a token in flight must reach the host first
        request.image_embeds = [None] * len(request.images)
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)
        if request in plan.decode:
            plan.decode.remove(request)

    def _release(self, request: Request) -> None:
        if request.pages:
            self.cache_computed([request])
            self.pages.free(request.pages)
            request.pages = []
        request.pages_cached = 0


def _decode_ready(request: Request) -> bool:
    """Its prompt is in the cache and its newest token was sampled but not yet fed: on the host,
    or in flight from a decode step (whose row feeds it on the device). A request whose tokens,
    in flight included, reach max_new_tokens is done and waits only for them."""
    if request.pending and not request.pending_decode:
        return False
    return (bool(request.output_ids) and request.num_computed == request.seq_len - 1
            and len(request.output_ids) + request.pending < request.sampling.max_new_tokens)
