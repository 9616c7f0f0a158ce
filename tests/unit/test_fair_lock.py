"""The engine's lock (`mmpipe.engine.fair_lock`): reentrant, and a thread that takes it back again
and again (the stream loop) cannot keep it from a thread waiting for it."""

from __future__ import annotations

import threading
import time

import pytest

from mmpipe.engine.fair_lock import FairRLock


def test_reentrant_and_only_its_owner_releases_it():
    lock = FairRLock()
    with lock:
        with lock:
            pass
        taken, release = [], threading.Event()

        def other_thread():
            taken.append(lock.acquire())
            release.wait(5)
            lock.release()

        other = threading.Thread(target=other_thread)
        other.start()
        time.sleep(0.2)
        assert not taken  # still held by this thread (depth 1)
    deadline = time.monotonic() + 5
    while not taken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert taken == [True]
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()  # the other thread owns it now
    release.set()
    other.join(5)


def test_a_release_hands_the_lock_to_the_waiter_before_its_owner_can_take_it_back():
    """The stream loop releases the lock and takes it again at once; with a waiter queued, the
    lock must already be the waiter's (a plain RLock is free again for whoever runs first)."""
    lock = FairRLock()
    lock.acquire()
    entered, leave = threading.Event(), threading.Event()

    def waiter():
        with lock:
            entered.set()
            leave.wait(5)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)  # the waiter is queued
    lock.release()
    assert not lock.acquire(blocking=False)  # handed over, though the waiter may not have run yet
    assert entered.wait(5)
    leave.set()
    thread.join(5)
    assert lock.acquire(blocking=False)
    lock.release()


def test_a_thread_taking_it_back_in_a_loop_hands_it_to_a_waiter_at_once():
    lock, stop = FairRLock(), threading.Event()
    rounds = [0]

    def busy():
        while not stop.is_set():
            with lock:
                rounds[0] += 1
                time.sleep(0.002)  # a step: the GPU's time, the interpreter free
            for _ in range(3000):  # then handing out its text: interpreter work, the lock free
                pass

    loop = threading.Thread(target=busy)
    loop.start()
    time.sleep(0.05)
    waited = []
    for _ in range(5):
        before = rounds[0]
        with lock:
            waited.append(rounds[0] - before)
    stop.set()
    loop.join(5)
    assert max(waited) <= 2  # served after at most the round in progress and one more


def test_waiters_are_served_in_arrival_order():
    lock, order = FairRLock(), []
    lock.acquire()
    threads = []
    for i in range(4):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()))
        t.start()
        time.sleep(0.05)  # each one is waiting before the next asks
        threads.append(t)
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3]
