"""Waiting for an engine to go idle, for tests that abort or overload requests."""

from __future__ import annotations

import time
from typing import Any


def idle(engine: Any, timeout: float = 10.0) -> bool:
    """Whether the engine (a Pipeline, or the server's `LocalEngine` or `EngineProcess`: anything
    with `stats()`) has no running request and every KV page free, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["kv_pages"]["free"] == stats["kv_pages"]["total"] and stats["requests"]["running"] == 0:
            return True
        time.sleep(0.02)
    return False


def frozen_objects(pipe: Any) -> int:
    """Run in an engine process (`EngineProcess.call`): how many objects are frozen out of the
    garbage collector's view there."""
    import gc

    return gc.get_freeze_count()
