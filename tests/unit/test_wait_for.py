"""`host_tokens.wait_for`: with `blocking-sync` on (the default) the engine looks at the step's event
between short sleeps and returns at the first look that finds it passed, never handing the wait to
the driver; with it off, the driver's wait (a spin) alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mmpipe.language import host_tokens


class FakeEvent:
    """Passed after `pending` looks; records the waits asked of it."""

    def __init__(self, pending: int) -> None:
        self.pending, self.looks, self.synchronized = pending, 0, 0

    def query(self) -> bool:
        self.looks += 1
        return self.looks > self.pending

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The sleeps `wait_for` asks for (none really taken; only that module's `time` is replaced)."""
    asked: list[float] = []
    monkeypatch.setattr(host_tokens, "time", SimpleNamespace(sleep=asked.append))
    return asked


@pytest.mark.parametrize("pending", [0, 1, 5])
def test_blocking_sync_sleeps_between_looks_until_the_event_has_passed(switch, sleeps, pending):
    switch("blocking-sync", "1")
    event = FakeEvent(pending)
    host_tokens.wait_for(event)
    assert event.looks == pending + 1  # stops at the first look that finds it passed
    assert sleeps == [host_tokens.POLL_SECONDS] * pending
    assert 0 < host_tokens.POLL_SECONDS <= 1e-4  # short against a step: a wake-up soon after the GPU is done
    assert event.synchronized == 0


def test_without_blocking_sync_the_driver_waits(switch, sleeps):
    switch("blocking-sync", "0")
    event = FakeEvent(3)
    host_tokens.wait_for(event)
    assert event.synchronized == 1 and event.looks == 0 and sleeps == []
