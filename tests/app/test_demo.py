"""The Gradio demo: history -> conversation, settings -> sampling, streaming and stop on the
backend, and the real server on a localhost port driven by gradio_client."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from mmpipe.app.demo_chat import ERROR_TITLE, IMAGE_ONLY_PROMPT, ChatBackend, Settings, to_conversation

from mmpipe import Pipeline, SamplingParams
from tests.demo_helpers import EXPECTED, StepRecorder, free_port, sample, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pipe():
    p = Pipeline.from_pretrained(device="cpu")
    yield p
    p.close()


def respond_all(backend, message, history=(), **settings):
    return list(backend.respond(message, list(history), **settings))


# ---------------------------------------------------------------------- history and settings


def test_history_of_both_gradio_shapes_becomes_one_conversation():
    a, b = sample("scene_0.png"), sample("scene_1.png")
    api_history = [{"role": "user", "content": [{"path": a}, "What is this?"]},
                   {"role": "assistant", "content": "a scene"}]
    browser_history = [{"role": "user", "content": [{"type": "file", "file": {"path": a, "mime_type": "image/png"}},
                                                    {"type": "text", "text": "What is this?"}]},
                       {"role": "assistant", "content": [{"type": "text", "text": "a scene"}], "metadata": None}]
    expected = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "a scene"}]},
                {"role": "user", "content": [{"type": "image", "image": b}, {"type": "text", "text": "And this?"}]}]
    for history in (api_history, browser_history):
        assert to_conversation({"text": "And this?", "files": [b]}, history, "Be brief.") == expected
    # Gradio can store one turn as several messages (files, then text): they are merged.
    split = [{"role": "user", "content": {"path": a}}, {"role": "user", "content": "What is this?"},
             {"role": "assistant", "content": "a scene"}]
    assert to_conversation({"text": "And this?", "files": [{"path": b}]}, split, "Be brief.") == expected


def test_error_turns_are_dropped_and_an_image_alone_gets_the_caption_question():
    good, bad = sample("scene_0.png"), "/tmp/upload/bad.png"
    history = [{"role": "user", "content": [{"path": good}, "Describe this image."]},
               {"role": "assistant", "content": "a scene"},
               {"role": "user", "content": [{"path": bad}, "And this?"]},
               {"role": "assistant", "content": "not an image", "metadata": {"title": ERROR_TITLE}}]
    conv = to_conversation({"text": "", "files": [sample("scene_2.png")]}, history)
    assert [m["role"] for m in conv] == ["user", "assistant", "user"]
    assert all(item.get("image") != bad for m in conv for item in m["content"])
    assert conv[-1]["content"] == [{"type": "image", "image": sample("scene_2.png")},
                                   {"type": "text", "text": IMAGE_ONLY_PROMPT}]
    with pytest.raises(ValueError, match="empty"):
        to_conversation({"text": "  ", "files": []}, history)


def test_each_setting_reaches_its_own_sampling_field():
    settings = Settings.from_inputs(" sys ", 17, 0.7, 0.85, 23, 1.3, 5.0)
    assert settings.system_prompt == "sys"
    assert settings.sampling() == SamplingParams(max_new_tokens=17, temperature=0.7, top_p=0.85, top_k=23,
                                                 repetition_penalty=1.3, seed=5)
    assert Settings.from_inputs("", 8, 0, 1, 0, 1, None).seed is None
    with pytest.raises(ValueError, match="seed"):
        Settings.from_inputs("", 8, 0, 1, 0, 1, 1.5)
    # What the page's seed field sends: text, empty (or blank) meaning unseeded.
    assert [Settings.from_inputs("", 8, 0, 1, 0, 1, v).seed for v in ("", "  ", " 7 ", "12")] == [None, None, 7, 12]
    with pytest.raises(ValueError, match="seed"):
        Settings.from_inputs("", 8, 0, 1, 0, 1, "x")


def test_the_page_seed_field_starts_empty_and_empty_means_unseeded(pipe):
    """The page's seed field is sent as it stands: left alone it must mean unseeded (a Number field
    shows and sends 0 when empty, so every retry at a high temperature gave the same answer)."""
    gr = pytest.importorskip("gradio")
    from mmpipe.app.demo_page import build_ui

    demo = build_ui(ChatBackend(pipe))
    seeds = [b for b in demo.blocks.values() if str(getattr(b, "label", "")).startswith("Seed")]
    assert len(seeds) == 1
    field = seeds[0]
    assert isinstance(field, gr.Textbox) and field.value == ""
    assert Settings.from_inputs("", 8, 2.0, 1, 0, 1, field.value).sampling().seed is None


# ---------------------------------------------------------------------- the backend


def test_answer_streams_as_growing_prefixes_with_live_statistics(pipe):
    backend = ChatBackend(pipe, update_interval_s=0.0)
    updates = respond_all(backend, {"text": "Describe this image.", "files": [sample("scene_1.png")]})
    texts = [u[0] for u in updates]
    assert len(texts) >= 5, "the answer should arrive in many pieces"
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert texts[-1] == EXPECTED["scene_1.png"]
    first, final = updates[0][1], updates[-1][1]
    assert "so far" in first and "(stop)" in final
    ttft = float(re.search(r"Time to first token \| (\d+) ms", final).group(1))
    generated = int(re.search(r"Generated \| (\d+) tokens", final).group(1))
    image_tokens = int(re.search(r"(\d+) of them from 1 image", final).group(1))
    assert ttft >= 0 and generated == len(pipe.tokenizer(EXPECTED["scene_1.png"])["input_ids"]) + 1  # + EOS
    assert image_tokens == pipe.processor.load_image(sample("scene_1.png"), "test").num_tokens
    assert "0 running, 0 waiting" in updates[-1][2]


def test_max_new_tokens_and_seed_reach_the_sampler(pipe):
    backend = ChatBackend(pipe)
    message = {"text": "Describe this image.", "files": [sample("scene_5.png")]}
    short = respond_all(backend, message, max_new_tokens=4)[-1]
    assert "Generated | 4 tokens (length)" in short[1]
    hot = dict(temperature=1.8, top_p=1.0, top_k=0, max_new_tokens=24)
    same = {respond_all(backend, message, seed=11, **hot)[-1][0] for _ in range(2)}
    assert len(same) == 1
    varied = {respond_all(backend, message, seed=s, **hot)[-1][0] for s in range(6)}
    assert len(varied) >= 3, varied
    greedy = {respond_all(backend, message, seed=s, temperature=0.0)[-1][0] for s in range(3)}
    assert greedy == {EXPECTED["scene_5.png"]}


def test_closing_an_answer_aborts_it_and_frees_its_pages(pipe):
    backend = ChatBackend(pipe, update_interval_s=0.0)
    gen = backend.respond({"text": "Describe this image.", "files": [sample("scene_0.png")]}, [],
                          max_new_tokens=200)
    text, panel, _ = next(gen)
    assert pipe.stats()["requests"]["running"] == 1
    assert pipe.stats()["kv_pages"]["free"] < pipe.stats()["kv_pages"]["total"]
    gen.close()
    stats = pipe.stats()
    assert stats["requests"] == {**stats["requests"], "running": 0, "waiting": 0}
    assert stats["kv_pages"]["free"] == stats["kv_pages"]["total"]


def test_bad_input_is_an_error_reply_naming_the_file(pipe, tmp_path):
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 20)
    backend = ChatBackend(pipe)
    (reply, panel, _), = respond_all(backend, {"text": "What is this?", "files": [str(corrupt)]})
    assert reply["metadata"]["title"] == ERROR_TITLE
    assert "'broken.png'" in reply["content"] and str(tmp_path) not in reply["content"]
    (reply, _, _), = respond_all(backend, {"text": "hi", "files": []}, top_p=0.0)
    assert "top_p" in reply["content"]


# ---------------------------------------------------------------------- the real server

try:
    import gradio_client
except ImportError:  # the server tests skip; the ones above still run
    gradio_client = None


@pytest.fixture(scope="module")
def server(pipe):
    pytest.importorskip("gradio")
    from mmpipe.app.demo_page import launch

    recorder = StepRecorder(delay_s=0.02).install(pipe)
    demo, url = launch(ChatBackend(pipe, concurrency=4), port=free_port(), block=False, quiet=True)
    yield url, recorder, pipe.processor.load_image(sample("scene_1.png"), "test").num_tokens
    demo.close()


def ask(client, text, *images, **kwargs):
    message = {"text": text, "files": [gradio_client.handle_file(p) for p in images]}
    return client.predict(message, api_name="/chat", **kwargs)


def test_server_captions_a_sample_scene_and_keeps_earlier_images(server):
    url, _, image_tokens = server
    client = gradio_client.Client(url, verbose=False)
    reply, answer, engine = ask(client, "Describe this image.", sample("scene_1.png"))
    assert reply == EXPECTED["scene_1.png"]
    assert "Time to first token" in answer and f"{image_tokens} of them from 1 image" in answer
    hits = int(re.search(r"(\d+) hits", engine).group(1))
    reply, answer, engine = ask(client, "Describe this image again.")  # text only: the image is history
    assert f"{image_tokens} of them from 1 image" in answer
    assert int(re.search(r"(\d+) hits", engine).group(1)) == hits + 1  # not encoded a second time


def test_two_clients_at_once_get_their_own_answers_batched_together(server):
    url, recorder, _ = server
    recorder.max_running = 0
    clients = [gradio_client.Client(url, verbose=False) for _ in range(2)]
    jobs = [c.submit({"text": "Describe this image.", "files": [gradio_client.handle_file(sample(name))]},
                     api_name="/chat") for c, name in zip(clients, ("scene_0.png", "scene_5.png"))]
    replies = [job.result(timeout=120)[0] for job in jobs]
    assert replies == [EXPECTED["scene_0.png"], EXPECTED["scene_5.png"]]
    assert recorder.max_running >= 2, "the two answers never shared an engine step"


def test_concurrency_holds_for_the_page_and_the_api_together(pipe):
    backend = ChatBackend(pipe, update_interval_s=0.0, concurrency=1)
    message = {"text": "Describe this image.", "files": [sample("scene_0.png")]}
    first = backend.respond(message, [])
    next(first)  # the first answer holds the only slot
    second = backend.respond(message, [])
    waiting = next(second)
    assert "waiting for a free slot" in waiting[1] and pipe.stats()["requests"]["running"] <= 1
    list(first)  # the first answer ends and frees its slot
    assert list(second)[-1][0] == EXPECTED["scene_0.png"]


def test_settings_outside_the_usual_ranges_and_odd_numbers(pipe):
    backend = ChatBackend(pipe)
    message = {"text": "Describe this image.", "files": [sample("scene_0.png")]}
    for bad in ({"seed": float("inf")}, {"max_new_tokens": float("nan")}, {"top_k": "x"}):
        (reply, _, _), = respond_all(backend, message, **bad)
        assert reply["metadata"]["title"] == ERROR_TITLE, bad
    assert Settings.from_inputs("", "5.0", 0, 1, 0, 1, None).max_new_tokens == 5


def test_defaults_outside_the_slider_ranges_still_answer(pipe):
    """Instruct checkpoints ship top_p=0.001, top_k=1: the sliders must accept them."""
    import dataclasses

    pytest.importorskip("gradio")
    from mmpipe.app.demo_page import launch

    saved = pipe.defaults
    pipe.defaults = dataclasses.replace(saved, temperature=0.1, top_p=0.001, top_k=1, repetition_penalty=1.05)
    try:
        demo, url = launch(ChatBackend(pipe), port=free_port(), block=False, quiet=True)
        try:
            reply = ask(gradio_client.Client(url, verbose=False), "Describe this image.", sample("scene_3.png"))[0]
            assert reply == EXPECTED["scene_3.png"]  # top_k=1 is greedy
        finally:
            demo.close()
    finally:
        pipe.defaults = saved


def test_the_server_contacts_no_other_host(pipe):
    """Gradio's analytics and version check stay off: no name lookup but localhost's."""
    pytest.importorskip("gradio")
    from mmpipe.app.demo_page import launch

    lookups: list[str] = []
    sys.addaudithook(lambda event, args: lookups.append(str(args[0])) if event == "socket.getaddrinfo" else None)
    demo, url = launch(ChatBackend(pipe), port=free_port(), block=False, quiet=True)
    try:
        ask(gradio_client.Client(url, verbose=False), "Describe this image.", sample("scene_1.png"))
        time.sleep(1.0)  # analytics run on background threads
    finally:
        demo.close()
    assert not [host for host in lookups if host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0")], lookups


def test_corrupt_upload_gets_an_error_reply_and_the_server_keeps_serving(server, tmp_path):
    url, _, _ = server
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(open(sample("scene_2.png"), "rb").read()[:200])  # a truncated PNG
    client = gradio_client.Client(url, verbose=False)
    reply = ask(client, "What is this?", str(corrupt))[0]
    assert reply["metadata"]["title"] == ERROR_TITLE and "corrupt.png" in reply["content"]
    other = gradio_client.Client(url, verbose=False)
    assert ask(other, "Describe this image.", sample("scene_3.png"))[0] == EXPECTED["scene_3.png"]
    # The same chat goes on: the failed turn is left out of its history.
    assert ask(client, "Describe this image.", sample("scene_4.png"))[0] == EXPECTED["scene_4.png"]


@pytest.mark.slow
def test_demo_command_starts_a_server_and_rejects_bad_flags():
    pytest.importorskip("gradio")
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mmpipe.app.demo", "--port", str(port), "--device", "cpu"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: any(url in line for line in lines) or proc.poll() is not None, 120, "the server to start")
        assert proc.poll() is None, "".join(lines)
        client = gradio_client.Client(url, verbose=False)
        assert ask(client, "Describe this image.", sample("scene_2.png"))[0] == EXPECTED["scene_2.png"]
    finally:
        proc.terminate()
        proc.wait(30)
    bad = subprocess.run([sys.executable, "-m", "mmpipe.cli", "demo", "--concurrency", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--concurrency" in bad.stderr and "Traceback" not in bad.stderr


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
    import concurrent.futures as futures

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
                wait_for(lambda: job.outputs() or job.done(), 120, "a first update")
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
    import concurrent.futures as futures

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


def test_demo_engine_flags_reach_the_pipeline(monkeypatch, capsys):
    """`--tp`, `--vit-parallel` and `--quantization` become the Pipeline's settings; `--tp 0` is refused by name
    (EngineConfig), as one line and exit code 2, before any server starts."""
    from mmpipe.app.demo import main

    from mmpipe import Pipeline
    from mmpipe.errors import InputError

    seen = {}

    def from_pretrained(*args, **kwargs):
        seen.update(kwargs)
        raise InputError("stopped before the server (test)")

    monkeypatch.setattr(Pipeline, "from_pretrained", from_pretrained)
    assert main(["--device", "cpu", "--tp", "2", "--vit-parallel", "tensor", "--quantization", "fp8"]) == 2
    assert seen["tensor_parallel_size"] == 2 and seen["quantization"] == "fp8" and seen["vit_parallel"] == "tensor"
    seen.clear()
    assert main(["--device", "cpu"]) == 2 and "tensor_parallel_size" not in seen and "vit_parallel" not in seen
    monkeypatch.undo()
    assert main(["--device", "cpu", "--tp", "0"]) == 2
    assert "tensor_parallel_size=0: must be a positive integer" in capsys.readouterr().err
