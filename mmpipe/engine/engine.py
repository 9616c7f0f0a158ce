"""The continuous-batching engine: requests in, one scheduled step at a time, finished requests out.

A step: the scheduler plans it; the images its prompt chunks need come from the encoder cache or
are encoded (packed into ViT calls within the patch budget); one prefill forward runs the prompt
chunks and samples the requests whose prompt it completes; one decode step (a CUDA graph with the
sampler inside, where graphs are on) advances every decoding request by a token. Finished requests release their KV pages before the next step.

Not thread-safe by itself: callers that share an engine across threads hold `Engine.lock`
around `add`, `abort` and `step` (the Pipeline does).
"""

from __future__ import annotations

import threading

import torch

from mmpipe.config import EngineConfig
from mmpipe.engine.encoder_cache import EncoderCache
from mmpipe.engine.model_runner import ModelRunner
from mmpipe.engine.request import Request
from mmpipe.engine.scheduler import StepPlan, Scheduler


class Engine:
    def __init__(self, runner: ModelRunner, cfg: EngineConfig) -> None:
        self.runner, self.cfg = runner, cfg
        self.cache = EncoderCache(cfg.encoder_cache_bytes)
        self.scheduler = Scheduler(cfg, runner.pages, runner.page_size, self.cache)
        self.lock = threading.RLock()
        self.steps = 0

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add(self, request: Request) -> None:
        if request.finished:
            raise ValueError("cannot add a finished request")
        self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        """Stop a request now and free its pages (no-op if it already finished)."""
        if not request.finished:
            self.scheduler.abort(request)
            self.runner.release([request])

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        if plan.preempted:
            self.runner.release(plan.preempted)
        if plan.empty:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("the scheduler could not place any request (KV cache too small for the "
                                   "oldest waiting request)")
            return []
        touched: list[Request] = []
        try:
            self._provide_images(plan)
            if plan.prefill:
                logits = self.runner.prefill(plan.prefill)
                done = [c.request for c in plan.prefill if c.completes]
                if done:
                    self.runner.sample(done, logits)
                touched += done
            if plan.decode:
                self.runner.decode(plan.decode)  # samples inside the step
                touched += plan.decode
        except BaseException:
            # Requests that finished before the failure are done (their pages go back); every
            # other request of the step goes back in line, to be recomputed from its tokens, so
            # the engine stays usable for whoever steps it next. Then report the failure.
            stepped = [c.request for c in plan.prefill] + plan.decode
            done = [r for r in stepped if r.finished]
            for request in done:
                self.scheduler.finish(request)
            self.runner.release(stepped)
            self.scheduler.requeue([r for r in stepped if not r.finished])
            raise
        finished = [r for r in touched if r.finished]
        for request in finished:
            self.scheduler.finish(request)
        self.runner.release(finished)
        self.steps += 1
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
        encoded = self.runner.encode_images([r.images[i] for r, i in unique.values()])
        by_key = dict(zip(unique, encoded))
        for key, embeds in by_key.items():
            self.cache.put(key, embeds)
        for request, index in missing:
            request.image_embeds[index] = by_key[request.images[index].key]
