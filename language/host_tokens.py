"""A step's tokens on their way to the host, and how the engine waits for them."""

from __future__ import annotations

import time

import torch
from mmpipe.language.sampler import SampleResult

from mmpipe import settings
from mmpipe.trace import phase

POLL_SECONDS = 20e-6  # asked of the OS between looks (the kernel's timer slack lengthens each sleep)


def wait_for(event: torch.cuda.Event) -> None:
    """Return once the GPU has passed `event`. By default the thread sleeps between short looks
    at the event: it neither spins a core for the milliseconds a step runs nor waits for the
    driver to wake it, as a blocking event's waiter does, well after the GPU is done (that delay
    lands on every time to first token). `MMPIPE_DISABLE=blocking-sync` waits in the driver
    instead (a spin, or a yield where CUDA's scheduling chooses one)."""
    if not settings.current().blocking_sync:
        event.synchronize()
        return
    while not event.query():
        time.sleep(POLL_SECONDS)


class HostTokens:
    """The first `n` rows of a `SampleResult` on their way to the host: the device-to-host copies
    are queued on the current stream at once (into pinned memory, so they do not wait for the
    GPU) and `get()` waits for them. Queued right after a graph replay, the copy holds this
    step's values even if the graph's output buffers are overwritten by the next replay.
    Log-probabilities travel only when `logprobs` is set and the result has them."""

    def __init__(self, result: SampleResult, n: int, logprobs: bool) -> None:
        if logprobs and result.top_ids is not None and result.token_logprobs is not None:
            ids = torch.cat([result.tokens[:n, None], result.top_ids[:n]], dim=1)
            lps: torch.Tensor | None = torch.cat([result.token_logprobs[:n, None],
                                                  result.top_logprobs[:n]], dim=1)  # type: ignore[index]
        else:
            ids, lps = result.tokens[:n, None], None
        self._event: torch.cuda.Event | None = None
        if ids.is_cuda:
            self._ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True).copy_(ids, non_blocking=True)
            self._lps = (torch.empty(lps.shape, dtype=lps.dtype, pin_memory=True).copy_(lps, non_blocking=True)
                         if lps is not None else None)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._ids, self._lps = ids.clone(), lps.clone() if lps is not None else None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> tuple[list[list[int]], list[list[float]] | None]:
        """Per row: [token, top ids...] and [token logprob, top logprobs...] (None without them)."""
        if self._event is not None:
            with phase("wait"):  # the host idles until the GPU reaches the copy
                wait_for(self._event)
        return self._ids.tolist(), self._lps.tolist() if self._lps is not None else None
