"""Static batching: the simplest correct way to run many requests.

Requests are taken in arrival order into a group while their whole KV footprint (prompt +
max_new_tokens) fits in free pages and the group is below `max_running_requests`. The group's
images are encoded, its prompts prefilled in chunks of at most `max_prefill_tokens`, then it
decodes until every member is done; only then does the next group start. This is what a
`transformers.generate` loop does, on the paged cache; the continuous-batching engine replaces
it and is measured against it.
"""

from __future__ import annotations

from typing import Sequence

from mmpipe.language.kv_cache import pages_needed
from mmpipe.engine.model_runner import ModelRunner, PrefillChunk
from mmpipe.engine.request import Request


class SimpleLoop:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(self, requests: Sequence[Request]) -> None:
        pending = list(requests)
        while pending:
            group = self._admit(pending)
            pending = pending[len(group):]
            try:
                self._run_group([r for r in group if not r.finished])
            finally:
                for request in group:
                    self.runner.pages.free(request.pages)
                    request.pages = []

    def _admit(self, pending: list[Request]) -> list[Request]:
        runner = self.runner
        free = runner.pages.num_free
        group: list[Request] = []
        for request in pending:
            need = pages_needed(request.prompt_len + request.sampling.max_new_tokens, runner.page_size)
            if need > runner.pages.capacity:
                request.finish("error", f"needs {need} KV pages, the cache has {runner.pages.capacity}")
                group.append(request)
                continue
            if need > free or len(group) >= runner.cfg.max_running_requests:
                break
            request.pages = runner.pages.allocate(need)
            free -= need
            group.append(request)
        return group

    def _run_group(self, group: list[Request]) -> None:
        if not group:
            return
        runner = self.runner
        for request in group:
            request.mark_scheduled()
        runner.encode_requests(group)
        budget = runner.cfg.max_prefill_tokens
        chunks: list[PrefillChunk] = []
        used = 0
        for request in group:
            start = 0
            while start < request.prompt_len:
                take = min(request.prompt_len - start, budget - used)
                chunks.append(PrefillChunk(request, start, start + take))
                start += take
                used += take
                if used == budget:
                    self._prefill(chunks)
                    chunks, used = [], 0
        if chunks:
            self._prefill(chunks)
        active = [r for r in group if not r.finished]
        while active:
            runner.decode(active)
            active = [r for r in active if not r.finished]

    def _prefill(self, chunks: list[PrefillChunk]) -> None:
        logits = self.runner.prefill(chunks)
        done = [c.request for c in chunks if c.completes]
        if done:
            self.runner.sample(done, logits)
