"""The engine's lock: reentrant, and granted in the order threads asked for it.

The stream loop steps the engine under this lock again and again; with a plain `RLock` the loop's
thread, running, takes it back before a woken waiter does, so `Pipeline.stats()`, a batch call or
a server's scrape could wait until every stream had ended. Here a thread that releases the lock
while others wait hands it straight to the one that has waited longest.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class FairRLock:
    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the fields below, held only briefly
        self._owner: int | None = None
        self._depth = 0
        self._waiting: collections.deque[tuple[int, threading.Lock]] = collections.deque()

    def acquire(self, blocking: bool = True) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiting:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            turn = threading.Lock()
            turn.acquire()
            self._waiting.append((me, turn))
        turn.acquire()  # released by the owner that hands the lock over (ownership already set)
        return True

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a FairRLock not held by this thread")
            self._depth -= 1
            if self._depth:
                return
            if self._waiting:
                self._owner, turn = self._waiting.popleft()
                self._depth = 1
                turn.release()
            else:
                self._owner = None

    def __enter__(self) -> "FairRLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
