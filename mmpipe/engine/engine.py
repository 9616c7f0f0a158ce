"""The continuous-batching engine: requests in, one scheduled step at a time, finished requests out.

A step: the scheduler plans it; the images its prompt chunks need come from the encoder cache or
are encoded (packed into ViT calls within the patch budget; with `EngineConfig.vision_stream`
on a stream of their own, which the prefill waits for on the device); one prefill forward runs
the prompt chunks and samples the requests whose prompt it completes; one decode step (a CUDA
graph with the sampler inside, where graphs are on) advances every decoding request by a token.
The sampled tokens are copied to the host without waiting for the GPU.

Overlapped scheduling (`EngineConfig.overlap_schedule`, on by default on CUDA): `step()` plans
and launches step N, then reads step N-1's tokens, so the host's work for one step (planning,
metadata, launches, stop checks, detokenising) runs while the GPU executes the step before it.
Results are exactly those of the plain order: a request's token in flight counts in its length,
and a request found finished when its tokens arrive has its extra row in the step already
launched dropped, never shown. Off, every step's tokens are read before `step()` returns.
Finished requests release their KV pages as soon as their last token is read.

Prefix caching: after each launch the pages its requests filled are registered in the cache
(`Scheduler.cache_computed`; every later reader is queued after the writes on the same stream),
and the logits of the prompts it completed are kept; a new request whose prompt was prefilled
before samples its first token from them in the step that admits it (`first_token_cache`).

Structured output: a decode step with a row constrained by a grammar is launched in two parts
(`ModelRunner.finish_decode`): its forward, then, once the step before's tokens are read and the
grammars advanced by them, its masks and its sampler, so the grammars' host work overlaps the
forward on the GPU.

Not thread-safe by itself: callers that share an engine across threads hold `Engine.lock`
around `add`, `abort` and `step` (the Pipeline does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from mmpipe.config import EngineConfig
from mmpipe.step_io import PendingDecode
from mmpipe.engine.encoder_cache import EncoderCache
from mmpipe.engine.fair_lock import FairRLock
from mmpipe.engine.model_runner import ModelRunner
from mmpipe.engine.request import Request
from mmpipe.engine.scheduler import Scheduler, StepPlan
from mmpipe.errors import InputError
from mmpipe.trace import phase


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are still on their way to the host."""

    sampled: list[Request] = field(default_factory=list)  # prompts completed: first token (or next, if recomputed)
    prefill_tokens: PendingDecode | None = None
    decoded: list[Request] = field(default_factory=list)
    decode_tokens: PendingDecode | None = None
    prefilled: list[Request] = field(default_factory=list)  # every request with a prompt chunk in it
    first: list[Request] = field(default_factory=list)  # first tokens sampled from kept logits
    first_tokens: PendingDecode | None = None


class Engine:
    def __init__(self, runner: ModelRunner, cfg: EngineConfig) -> None:
        self.runner, self.cfg = runner, cfg
        self.cache = EncoderCache(cfg.encoder_cache_bytes)
        self.scheduler = Scheduler(cfg, runner.pages, runner.page_size, self.cache)
        self.lock = FairRLock()  # in arrival order: the stream loop's steps never starve other callers
        self.steps = 0
        self.overlap = cfg.overlap_schedule if cfg.overlap_schedule is not None else runner.device.type == "cuda"
        self._in_flight: LaunchedStep | None = None

    def add(self, request: Request) -> None:
        if request.finished:
            raise ValueError("cannot add a finished request")
        self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        """Stop a request now and free its pages (no-op if it already finished). A token of it
        still in flight is dropped when it arrives."""
        if not request.finished:
            self.scheduler.abort(request)
            self.runner.release([request])

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one step; returns the requests found finished in it (with overlap: those whose
        last token, sampled by the step before, arrived now)."""
        with phase("schedule"):
            plan = self.scheduler.schedule()
        if plan.preempted:
            self.runner.release(plan.preempted)
        if plan.empty:
            if self._in_flight is None and (self.scheduler.running or self.scheduler.waiting):
                raise RuntimeError("the scheduler could not place any request (KV cache too small for the "
                                   "oldest waiting request)")
            return self.drain()  # everything planned waits for tokens in flight
        previous, launched = self._in_flight, None
        try:
            launched = self._launch(plan)
            self._in_flight = launched
            self.scheduler.cache_computed([c.request for c in plan.prefill] + plan.decode)
            finished = self._resolve(previous) if previous is not None else []
            if launched.decode_tokens is not None and launched.decode_tokens.tokens is None:
                # A constrained step: its forward runs on the GPU while the tokens just read
                # advance the grammars; now their masks, then its sampler.
                with phase("grammar"):
                    self.runner.finish_decode(launched.decoded, launched.decode_tokens)
            if not self.overlap:
                finished += self.drain()
        except BaseException:
            self._recover(plan, [s for s in (previous, launched) if s is not None])
            raise
        self.steps += 1
        return finished

    def _recover(self, plan: StepPlan, unread: list[LaunchedStep]) -> None:
        """After a failed step: tokens not yet read are dropped; requests that finished before the
        failure are done (their pages go back); every other request of the step, or of a step
        still in flight, goes back in line to be recomputed from the tokens it has, so the engine
        stays usable for whoever steps it next. The prefix cache is emptied: a page written by an
        unfinished step may have been cached (at launch, or by a request aborted meanwhile)."""
        self._in_flight = None
        involved: dict[int, Request] = {}
        for request in [c.request for c in plan.prefill] + plan.decode + [r for r, _ in plan.first_tokens] + [
                r for step in unread for r in step.prefilled + step.decoded + step.first]:
            involved[id(request)] = request
            request.pending, request.pending_decode = 0, False
        requests = list(involved.values())
        self.reset_prefix_cache()
        self.scheduler.stop_caching(requests)  # nor are the pages they hold cached later
        for request in requests:
            if request.finished:
                self.scheduler.finish(request)
        self.runner.release(requests)
        self.scheduler.requeue([r for r in requests if not r.finished])

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV page (pages running requests hold stay theirs) and every kept
        first-token logits row; the number of pages forgotten."""
        self.scheduler.first_tokens.clear()
        return self.scheduler.pages.clear_cache()

    def drain(self) -> list[Request]:
        """Read the tokens of the step in flight, if any; returns the requests they finished."""
        launched, self._in_flight = self._in_flight, None
        return self._resolve(launched) if launched is not None else []

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        launched = LaunchedStep()
        if plan.images:
            with phase("vision"):
                self._provide_images(plan)
        if plan.prefill:
            with phase("prefill"):
                logits = self.runner.prefill(plan.prefill)
                launched.prefilled = [c.request for c in plan.prefill]
                launched.sampled = [c.request for c in plan.prefill if c.completes]
                if launched.sampled:
                    self.scheduler.keep_first_logits(launched.sampled, logits)
                    launched.prefill_tokens = self.runner.launch_sample(launched.sampled, logits)
        if plan.first_tokens:
            with phase("prefill"):
                launched.first = [r for r, _ in plan.first_tokens]
                rows = torch.cat([row for _, row in plan.first_tokens])
                launched.first_tokens = self.runner.launch_sample(launched.first, rows)
        if plan.decode:
            with phase("decode"):
                launched.decode_tokens = self.runner.launch_decode(plan.decode)  # samples inside the step
            launched.decoded = plan.decode
        for request in launched.sampled + launched.first:
            request.pending += 1
            request.pending_decode = False
        for request in launched.decoded:
            request.pending += 1
            request.pending_decode = True
        return launched

    def _resolve(self, launched: LaunchedStep) -> list[Request]:
        """Append the step's tokens to requests still running (a request that finished or was
        aborted since the launch drops its token), then release the requests they finished."""
        with phase("read"):
            return self._read(launched)

    def _read(self, launched: LaunchedStep) -> list[Request]:
        finished: list[Request] = []
        for requests, tokens in ((launched.sampled, launched.prefill_tokens), (launched.first, launched.first_tokens),
                                 (launched.decoded, launched.decode_tokens)):
            if tokens is None:
                continue
            out = tokens.get()
            for request in requests:
                request.pending -= 1
            live = [i for i, r in enumerate(requests) if not r.finished]
            if len(live) < len(requests):
                out = out.select(live)
                requests = [requests[i] for i in live]
            if tokens is launched.first_tokens:
                self.scheduler.prefix.first_tokens += len(requests)
            self.runner.apply_tokens(requests, out)
            finished += [r for r in requests if r.finished]
        for request in finished:
            self.scheduler.finish(request)
        self.runner.release(finished)
        return finished

    def _provide_images(self, plan: StepPlan) -> None:
        """Embeddings for the images this step's chunks need: cached ones, then encoded ones."""
        missing: list[tuple[Request, int]] = []
        for request, index in plan.images:
            cached = self.cache.get(request.images[index].key)
            if cached is not None:
                request.image_embeds[index] = cached
            else:
                missing.append((request, index))
        if not missing:
            return
        # The same new image twice in one step is encoded once.
        unique: dict[str, tuple[Request, int]] = {}
        for request, index in missing:
            unique.setdefault(request.images[index].key, (request, index))
        try:
            encoded = self.runner.encode_images([r.images[i] for r, i in unique.values()])
            by_key: dict[str, Any] = dict(zip(unique, encoded))
        except (torch.OutOfMemoryError, MemoryError):
            by_key = self._encode_one_by_one(unique, short_of_memory=True)
        except InputError:
            by_key = self._encode_one_by_one(unique, short_of_memory=False)
        for key, embeds in by_key.items():
            if isinstance(embeds, torch.Tensor):
                self.cache.put(key, embeds)
        for request, index in missing:
            embeds = by_key[request.images[index].key]
            if isinstance(embeds, str):  # this image cannot be encoded even alone: its request fails, the step goes on
                where = f"{request.where}, image {index}" if request.where else f"image {index}"
                self._fail(request, f"{where}: {embeds}")
            else:
                request.image_embeds[index] = embeds
        if any(c.request.finished for c in plan.prefill):  # failed above: its chunks leave the step
            plan.prefill[:] = [c for c in plan.prefill if not c.request.finished]

    def _encode_one_by_one(self, unique: dict[str, tuple[Request, int]], short_of_memory: bool) -> dict[str, Any]:
        """After a pack failed (out of device memory, or a file the GPU path found it cannot
        decode): each image alone (after running out of memory, with the allocator's free blocks
        returned to the device between tries); an image that still fails gets the reason instead
        of its embeddings."""
        out: dict[str, Any] = {}
        for key, (request, index) in unique.items():
            if short_of_memory:
                _release_cached_memory(self.runner.device)
            image = request.images[index]
            try:
                out[key] = self.runner.encode_images([image])[0]
            except (torch.OutOfMemoryError, MemoryError):
                out[key] = (f"out of GPU memory encoding it, even alone ({image.num_patches} patches); "
                            "lower max_pixels for it, or free GPU memory")
            except InputError as exc:
                out[key] = str(exc)
        if short_of_memory:
            _release_cached_memory(self.runner.device)
        return out

    def _fail(self, request: Request, message: str) -> None:
        """Finish one request with an error now (its pages back, out of the decode batch)."""
        if not request.finished:
            self.scheduler.finish(request)
            self.runner.release([request])
            request.finish("error", message)


def _release_cached_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
