"""Serving an app on loopback for the server's tests, and waiting for its engine to go idle."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port, on a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def idle(engine: Any, timeout: float = 10.0) -> bool:
    """Whether the engine (a Pipeline, `LocalEngine` or `EngineProcess`) has no running request and
    every KV page free, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["kv_pages"]["free"] == stats["kv_pages"]["total"] and stats["requests"]["running"] == 0:
            return True
        time.sleep(0.05)
    return False
