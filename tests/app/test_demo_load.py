"""The demo under load: answers driven from many threads on a GPU, 32 gradio_client users at once
with some stopping mid-answer, and a soak of 2,000 answers whose memory must stay flat (the
functional tests of the page are in test_demo.py)."""

from __future__ import annotations

import re

import pytest
from mmpipe.app.demo_chat import ChatBackend

from mmpipe import Pipeline
from tests.demo_helpers import EXPECTED, StepRecorder, free_port, sample, wait_for

try:
    import gradio_client
except ImportError:
    gradio_client = None


def respond_all(backend, message, history=(), **settings):
    return list(backend.respond(message, list(history), **settings))


def drive_from_pool(gen, pool):
    """Gradio calls a sync generator's next() from whichever worker thread is free: do the same."""
    updates = []
    while True:
        item = pool.submit(next, gen, None).result()
        if item is None:
            return updates
        updates.append(item)


@pytest.mark.gpu
def test_gpu_demo_answers_with_graphs_from_many_threads_and_stops_cleanly():
    from concurrent import futures

    cuda = Pipeline.from_pretrained(device="cuda", dtype="float32", num_kv_pages=2048)
    try:
        backend = ChatBackend(cuda, update_interval_s=0.0)
        names = ["scene_0.png", "scene_1.png", "scene_5.png"]
        recorder = StepRecorder(delay_s=0.0).install(cuda)
        gens = [backend.respond({"text": "Describe this image.", "files": [sample(n)]}, []) for n in names]
        with futures.ThreadPoolExecutor(8) as steps, futures.ThreadPoolExecutor(len(gens)) as drivers:
            results = list(drivers.map(lambda g: drive_from_pool(g, steps), gens))
        assert [r[-1][0] for r in results] == [EXPECTED[n] for n in names]
        assert recorder.max_running >= 2
        engine = results[-1][-1][2]
        for part in ("Prefill graphs", "Decode graphs"):
            live = re.search(part + r" \| (\d+) live", engine)
            assert live and int(live.group(1)) > 0, engine
        assert "Graph mode | full_and_piecewise" in engine
        recorder.delay_s = 0.02  # the stream loop runs ahead of its reader: slow it so the answer is mid-way
        gen = backend.respond({"text": "Describe this image.", "files": [sample("scene_2.png")]}, [],
                              max_new_tokens=200)
        next(gen)
        assert cuda.stats()["requests"]["running"] == 1
        gen.close()
        stats = cuda.stats()
        assert stats["requests"]["running"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]
    finally:
        cuda.close()
    # In bfloat16 the ViT runs as graphs too (its float32 attention path cannot be captured).
    bf16 = Pipeline.from_pretrained(device="cuda", dtype="bfloat16", num_kv_pages=2048)
    try:
        reply, _, engine = respond_all(ChatBackend(bf16), {"text": "Describe this image.",
                                                           "files": [sample("scene_3.png")]})[-1]
        assert reply == bf16.caption([sample("scene_3.png")])[0]
        live = re.search(r"ViT graphs \| (\d+) live", engine)
        assert live and int(live.group(1)) > 0, engine
    finally:
        bf16.close()


@pytest.mark.slow
def test_thirty_two_clients_at_once_each_get_their_own_answer(pipe):
    """32 gradio_client users at once, mixed images and text, every fourth one stopping mid-answer:
    every streamed update is a prefix of that user's own expected answer (never another's), every
    user who did not stop gets all of it, and the engine ends with no running request and every KV
    page free."""
    pytest.importorskip("gradio")
    import time as time_module

    from mmpipe.app.demo_page import launch

    names = sorted(EXPECTED)
    messages = [{"text": "Describe this image.", "files": [sample(n)]} for n in names]
    messages += [{"text": "What is a scene?", "files": []}, {"text": "Name three colours.", "files": []}]
    reference = ChatBackend(pipe, update_interval_s=0.0)
    expected = [respond_all(reference, m)[-1][0] for m in messages]
    assert expected[:len(names)] == [EXPECTED[n] for n in names]
    demo, url = launch(ChatBackend(pipe, concurrency=8), port=free_port(), block=False, quiet=True)
    try:
        start = time_module.monotonic()
        clients = [gradio_client.Client(url, verbose=False) for _ in range(32)]
        jobs = []
        for i, client in enumerate(clients):
            m = messages[i % len(messages)]
            payload = {"text": m["text"], "files": [gradio_client.handle_file(f) for f in m["files"]]}
            jobs.append((i, client.submit(payload, api_name="/chat")))
        stopped = set()
        for i, job in jobs:
            if i % 4 == 3:  # this user stops as soon as the first words arrive
                wait_for(lambda job=job: job.outputs() or job.done(), 120, "a first update")
                job.cancel()
                stopped.add(i)
        for i, job in jobs:
            want = expected[i % len(messages)]
            if i not in stopped:
                assert job.result(timeout=300)[0] == want, i
            else:
                wait_for(job.done, 120, "the stopped job to end")
            for update in job.outputs():
                assert want.startswith(update[0]), (i, update[0], want)
        wall = time_module.monotonic() - start

        def idle() -> bool:
            stats = pipe.stats()
            return stats["requests"]["running"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]

        wait_for(idle, 60, "the engine to be idle with every page free")
        print(f"32 clients: {wall:.1f} s wall, {32 - len(stopped)} complete answers checked, {len(stopped)} stopped")
    finally:
        demo.close()


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_soak_two_thousand_answers_keep_memory_flat(tmp_path, monkeypatch):
    """2,000 answers from 16 threads, each its own session, cycling through 40 distinct images and
    two text prompts: after a warm-up (caches filled to their bounds), the process's resident
    memory grows by less than a bound, and the per-session state stays bounded."""
    from concurrent import futures

    from mmpipe.app import demo_chat

    from tests.helpers import random_image

    monkeypatch.setattr(demo_chat, "SESSIONS_KEPT", 256)
    images = []
    for i in range(40):
        path = tmp_path / f"img{i}.png"
        random_image(64 + 8 * (i % 5), 64, seed=i).save(path)
        images.append(str(path))
    messages = [{"text": "Describe this image.", "files": [p]} for p in images]
    messages += [{"text": "What is a scene?", "files": []}, {"text": "Name three colours.", "files": []}]
    # Small caches, so they reach their bounds during the warm-up.
    soak = Pipeline.from_pretrained(device="cpu", encoder_cache_bytes=4 << 20, preprocessed_cache_bytes=2 << 20)
    backend = ChatBackend(soak, update_interval_s=0.0, concurrency=16)

    def answer(i: int) -> str:
        updates = respond_all(backend, messages[i % len(messages)], max_new_tokens=4, session=f"user{i}")
        return updates[-1][0]

    try:
        with futures.ThreadPoolExecutor(16) as pool:
            assert all(pool.map(answer, range(300)))  # warm-up
            before = _rss_bytes()
            assert all(pool.map(answer, range(300, 2000)))
        after = _rss_bytes()
        stats = soak.stats()
        assert stats["requests"]["running"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]
        assert len(backend._last) <= 256
        print(f"soak: resident memory {before / 2**20:.0f} MiB after the warm-up, {after / 2**20:.0f} MiB "
              "after 2,000 answers")
        assert after - before < 64 << 20
    finally:
        soak.close()
