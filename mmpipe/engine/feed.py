"""Feeding a call's requests to the engine: conversations prepared a bounded distance ahead, their
images decoded and preprocessed on worker threads, each request added as its images are ready, the
engine stepped, and every output yielded as its request finishes. Memory stays flat however many
requests a call holds, and host work overlaps the GPU's."""

from __future__ import annotations

import concurrent.futures as futures
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from mmpipe.engine.engine import Engine
from mmpipe.engine.processor import InputProcessor, Prepared
from mmpipe.engine.request import Request, failed_output
from mmpipe.errors import InputError
from mmpipe.outputs import RequestOutput

log = logging.getLogger("mmpipe")


@dataclass
class _Pending:
    prepared: Prepared
    images: list[futures.Future]


class RequestFeed:
    """One per Pipeline: its engine, input processor, image worker pool and the lock that guards
    the tokenizer (not safe to share across threads)."""

    def __init__(self, engine: Engine, processor: InputProcessor, pool: futures.ThreadPoolExecutor,
                 text_lock: threading.Lock) -> None:
        self.engine, self.processor, self._pool, self._text_lock = engine, processor, pool, text_lock

    def outputs_as_completed(self, specs: Iterable[tuple[int, Callable[[], Prepared]]],
                                 errors: str) -> Iterator[RequestOutput]:
        """Prepare requests a bounded distance ahead of the engine, add them in order as their
        images become ready, step the engine, and yield each output as its request finishes (a
        request that cannot be built is yielded at once). Memory is flat in the number of specs:
        finished requests are dropped once yielded. Closing the generator aborts what is running."""
        if errors not in ("raise", "return"):
            raise InputError(f"errors={errors!r}: use 'raise' or 'return'")
        window: deque[_Pending] = deque()
        running: set[Request] = set()
        done: deque[Request] = deque()
        failed: deque[RequestOutput] = deque()
        lookahead = max(8, 2 * self.engine.cfg.max_running_requests)
        budget = self.engine.cfg.input_bytes_ahead
        held = 0  # the resized pixels of the requests in the engine (`running`)
        # Loads in flight at once: enough to keep the workers busy, and no more than the byte budget
        # has room for at the inputs' size so far (one per worker until a first one is measured).
        workers = self.engine.cfg.preprocess_workers
        in_flight_cap = 4 * workers
        measured = [0, 0]  # requests read, their bytes
        # Conversations are prepared (chat template, tokens) a burst per loop, not the whole window
        # at once, so the first images start loading and the GPU gets work at once (a whole window
        # prepared up front kept the GPU idle at the start of a run).
        burst = 32
        it = iter(specs)
        exhausted = False

        def fail(index: int, exc: InputError) -> None:
            if errors == "raise":
                raise exc
            # The caller gets the error in the output: a warning would print it a second time.
            log.debug("request %d failed: %s", index, exc)
            failed.append(failed_output(index, str(exc)))

        def room(spent: int, in_flight: int) -> bool:
            """Whether one more request may be read, given the bytes read and held (`spent`) and
            the loads not yet done."""
            if len(window) >= lookahead:
                return False
            if not window and not held:  # nothing read and nothing running: always read one
                return True
            if spent > budget or in_flight >= in_flight_cap:
                return False
            if not measured[0]:  # no input measured yet: as many as the workers load at once
                return in_flight < workers
            return spent + (in_flight + 1) * measured[1] / measured[0] <= budget

        def refill() -> None:
            nonlocal exhausted
            # Measured once per call (the window may hold hundreds of requests); the loop then
            # counts what it adds itself.
            spent = held + _loaded_bytes(window)
            in_flight = sum(1 for pending in window if not all(f.done() for f in pending.images))
            for _ in range(burst):
                if not room(spent, in_flight):
                    return
                item = next(it, None)
                if item is None:
                    exhausted = True
                    return
                index, spec = item
                try:
                    with self._text_lock:
                        prepared = spec()
                except InputError as exc:
                    fail(index, exc)
                    continue
                window.append(_Pending(prepared, [
                    self._pool.submit(self.processor.load_image, src, self.processor.image_where(prepared, k))
                    for k, src in enumerate(prepared.image_sources)]))
                in_flight += bool(prepared.image_sources)

        try:
            while True:
                refill()
                while window and all(f.done() for f in window[0].images):
                    pending = window.popleft()
                    try:
                        loaded = [f.result() for f in pending.images]
                        with self._text_lock:
                            request = self.processor.assemble(pending.prepared, loaded)
                    except InputError as exc:
                        fail(pending.prepared.index, exc)
                        continue
                    request.on_finish = done.append
                    request.input_bytes = sum(_pixel_bytes(image) for image in request.images)
                    held += request.input_bytes
                    measured[0] += 1
                    measured[1] += request.input_bytes
                    running.add(request)
                    with self.engine.lock:
                        self.engine.add(request)
                while failed:
                    yield failed.popleft()
                while done:
                    request = done.popleft()
                    running.discard(request)
                    held -= request.input_bytes
                    with self.engine.lock:
                        output = request.to_output()
                    yield output
                # Checked under the lock: another thread's step may be finishing our requests.
                with self.engine.lock:
                    pending_work = any(not r.finished for r in running)
                    if pending_work:
                        self.engine.step()
                if not pending_work and not done:
                    if not window:
                        if exhausted and not failed:
                            break
                        continue
                    futures.wait(window[0].images, return_when=futures.ALL_COMPLETED)
        finally:  # an exception, or the consumer closed the generator early
            with self.engine.lock:
                for request in running:
                    self.engine.abort(request)
            for pending in window:
                for future in pending.images:
                    future.cancel()


def _pixel_bytes(item: object) -> int:
    """Host bytes of a loaded image or video: its resized pixels (a video: every frame group's),
    or a JPEG the GPU decodes."""
    groups = getattr(item, "groups", None)
    if groups is not None:
        return sum(_pixel_bytes(group) for group in groups)
    pixels = getattr(item, "pixels", None)
    if pixels is not None:
        return pixels.numel() * pixels.element_size()
    return len(getattr(item, "jpeg", None) or b"")


def _loaded_bytes(window: deque[_Pending]) -> int:
    """Bytes of the inputs loaded so far for requests not yet in the engine."""
    return sum(_pixel_bytes(f.result()) for pending in window for f in pending.images
               if f.done() and not f.cancelled() and f.exception() is None)
