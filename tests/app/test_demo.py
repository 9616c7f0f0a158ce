"""The Gradio demo: history -> conversation, settings -> sampling, streaming and stop on the
backend, and the real server on a localhost port driven by gradio_client, with images and videos
(the demo under load is test_demo_load.py)."""

from __future__ import annotations


import os
import re
import subprocess
import sys
import threading
import time

import pytest
from mmpipe.app.demo_chat import (
    ERROR_TITLE,
    IMAGE_ONLY_PROMPT,
    VIDEO_ONLY_PROMPT,
    ChatBackend,
    Settings,
    to_conversation,
)

from mmpipe import Pipeline, SamplingParams
from tests.demo_helpers import EXPECTED, StepRecorder, free_port, sample, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """A 3-second H.264 mp4 (24 frames at 8 fps): 6 frames, 3 frame groups at the demo's 2 fps."""
    from tests.video_helpers import make_video

    return make_video(tmp_path_factory.mktemp("video") / "clip.mp4", 24, 64, 48, fps=8)


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


def test_video_uploads_become_video_parts_with_the_page_sampling_and_stay_in_later_turns():
    image, video = sample("scene_0.png"), "/tmp/upload/clip.mp4"
    webm = "/tmp/upload/blob"  # no extension: the browser's MIME type says what it is
    browser_history = [{"role": "user", "content": [{"type": "file", "file": {"path": video, "mime_type": "video/mp4"}}]},
                       {"role": "user", "content": [{"type": "text", "text": "What happens?"}]},
                       {"role": "assistant", "content": [{"type": "text", "text": "a scene"}]},
                       {"role": "user", "content": [{"type": "file", "file": {"path": webm, "mime_type": "video/webm"}}]},
                       {"role": "assistant", "content": "another"}]
    api_history = [{"role": "user", "content": [{"path": video}, "What happens?"]},
                   {"role": "assistant", "content": "a scene"},
                   {"role": "user", "content": {"path": webm, "mime_type": "video/webm"}},
                   {"role": "assistant", "content": "another"}]
    keys = {"fps": 1.5, "max_frames": 8}
    expected = [{"role": "user", "content": [{"type": "video", "video": video, **keys},
                                             {"type": "text", "text": "What happens?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "a scene"}]},
                {"role": "user", "content": [{"type": "video", "video": webm, **keys},
                                             {"type": "text", "text": VIDEO_ONLY_PROMPT}]},  # a video alone, replayed
                {"role": "assistant", "content": [{"type": "text", "text": "another"}]},
                {"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "video", "video": "/tmp/upload/b.MKV", **keys},
                                             {"type": "text", "text": VIDEO_ONLY_PROMPT}]}]
    for history in (browser_history, api_history):
        assert to_conversation({"text": "", "files": [image, "/tmp/upload/b.MKV"]}, history, video=keys) == expected
    assert Settings().video() == Settings.from_inputs("", 8, 0, 1, 0, 1, None).video() == {"fps": 2.0,
                                                                                           "max_frames": 768}
    assert Settings.from_inputs("", 8, 0, 1, 0, 1, None, "0.5", 16.0).video() == {"fps": 0.5, "max_frames": 16}
    for bad in ((0, 16), (2, 1), (2, 3.5)):
        with pytest.raises(ValueError, match="fps|frames"):
            Settings.from_inputs("", 8, 0, 1, 0, 1, None, *bad).video()


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
    # The stream loop runs ahead of its reader: slowed steps keep the answer running while it is read.
    with StepRecorder(delay_s=0.02).installed(pipe):
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


def test_a_second_turn_shows_its_cached_prompt_in_both_panels(pipe):
    """The answer panel counts the prompt tokens found cached; the engine panel sums them up."""
    backend = ChatBackend(pipe, update_interval_s=0.0)
    message = {"text": "Describe this image.", "files": [sample("scene_2.png")]}
    first = respond_all(backend, message)[-1]
    history = [{"role": "user", "content": [{"path": sample("scene_2.png")}, "Describe this image."]},
               {"role": "assistant", "content": first[0]}]
    second = respond_all(backend, {"text": "Anything else?", "files": []}, history)[-1]
    prompt, cached = (int(v) for v in re.search(r"Prompt \| (\d+) tokens, .*; (\d+) found in the prefix cache",
                                                 second[1]).groups())
    image = pipe.processor.load_image(sample("scene_2.png"), "test").num_tokens
    assert image < cached < prompt
    found = re.search(r"Prefix cache \| \d+ pages, (\d+) hits in (\d+) requests, (\d+)% of prompt tokens", second[2])
    assert found and int(found.group(1)) >= 1


def test_max_new_tokens_and_seed_reach_the_sampler(pipe):
    backend = ChatBackend(pipe)
    message = {"text": "Describe this image.", "files": [sample("scene_5.png")]}
    short = respond_all(backend, message, max_new_tokens=4)[-1]
    assert "Generated | 4 tokens (length)" in short[1]
    hot = {"temperature": 1.8, "top_p": 1.0, "top_k": 0, "max_new_tokens": 24}
    same = {respond_all(backend, message, seed=11, **hot)[-1][0] for _ in range(2)}
    assert len(same) == 1
    varied = {respond_all(backend, message, seed=s, **hot)[-1][0] for s in range(6)}
    assert len(varied) >= 3, varied
    greedy = {respond_all(backend, message, seed=s, temperature=0.0)[-1][0] for s in range(3)}
    assert greedy == {EXPECTED["scene_5.png"]}


def test_closing_an_answer_aborts_it_and_frees_its_pages(pipe):
    backend = ChatBackend(pipe, update_interval_s=0.0)
    with StepRecorder(delay_s=0.02).installed(pipe):  # mid-answer when it is closed
        gen = backend.respond({"text": "Describe this image.", "files": [sample("scene_0.png")]}, [],
                              max_new_tokens=200)
        next(gen)
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
    (reply, _, _), = respond_all(backend, {"text": "What is this?", "files": [str(corrupt)]})
    assert reply["metadata"]["title"] == ERROR_TITLE
    assert "'broken.png'" in reply["content"] and str(tmp_path) not in reply["content"]
    (reply, _, _), = respond_all(backend, {"text": "hi", "files": []}, top_p=0.0)
    assert "top_p" in reply["content"]


def test_a_video_too_long_for_the_context_says_how_to_send_fewer_frames(pipe, tmp_path):
    from tests.video_helpers import make_video

    long = make_video(tmp_path / "long.mp4", 160, 64, 48, fps=8)  # 20 s: 40 frames at 2 fps
    backend = ChatBackend(pipe)
    (reply, _, _), = respond_all(backend, {"text": "", "files": [long]})
    assert reply["metadata"]["title"] == ERROR_TITLE and "max_model_len" in reply["content"], reply
    assert "'Video max frames'" in reply["content"]
    answer = respond_all(backend, {"text": "", "files": [long]}, video_max_frames=8)[-1][1]
    assert "from 1 video" in answer and re.search(r"Generated \| \d+ tokens \((length|stop)\)", answer), answer


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


def caches(engine_panel: str) -> dict[str, int]:
    """The encoder cache's misses and the prefix cache's hits, as the engine panel shows them."""
    misses = re.search(r"Encoder cache \| \d+ images, \d+ hits, (\d+) misses", engine_panel)
    prefix = re.search(r"Prefix cache \| \d+ pages, (\d+) hits", engine_panel)
    assert misses and prefix, engine_panel
    return {"misses": int(misses.group(1)), "prefix_hits": int(prefix.group(1))}


def cached_tokens(answer_panel: str) -> int:
    return int(re.search(r"(\d+) found in the prefix cache", answer_panel).group(1))


def test_server_captions_a_sample_scene_and_keeps_earlier_images(server):
    url, _, image_tokens = server
    client = gradio_client.Client(url, verbose=False)
    reply, answer, engine = ask(client, "Describe this image.", sample("scene_1.png"))
    assert reply == EXPECTED["scene_1.png"]
    assert "Time to first token" in answer and f"{image_tokens} of them from 1 image" in answer
    before = caches(engine)
    reply, answer, engine = ask(client, "Describe this image again.")  # text only: the image is history
    assert f"{image_tokens} of them from 1 image" in answer
    assert cached_tokens(answer) > image_tokens  # the first turn, its image included, from the prefix cache
    after = caches(engine)
    assert after["misses"] == before["misses"] and after["prefix_hits"] == before["prefix_hits"] + 1


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
    with open(sample("scene_2.png"), "rb") as png:
        corrupt.write_bytes(png.read()[:200])  # a truncated PNG
    client = gradio_client.Client(url, verbose=False)
    reply = ask(client, "What is this?", str(corrupt))[0]
    assert reply["metadata"]["title"] == ERROR_TITLE and "corrupt.png" in reply["content"]
    other = gradio_client.Client(url, verbose=False)
    assert ask(other, "Describe this image.", sample("scene_3.png"))[0] == EXPECTED["scene_3.png"]
    # The same chat goes on: the failed turn is left out of its history.
    assert ask(client, "Describe this image.", sample("scene_4.png"))[0] == EXPECTED["scene_4.png"]


def test_server_answers_about_a_video_and_keeps_it_in_later_turns(server, pipe, clip):
    """A video turn is answered as `Pipeline.chat` answers the same video part (the demo's 2 fps);
    a text-only follow-up still has the video in its prompt (its frame groups come from the
    encoder cache); the page's max-frames setting reaches the sampling."""
    url, _, _ = server
    first = [{"role": "user", "content": [{"type": "video", "video": clip}, {"type": "text", "text": VIDEO_ONLY_PROMPT}]}]
    with pipe.stream(first) as reference:
        want = "".join(reference)
        video_tokens, groups = reference.num_image_tokens, reference.num_images
    assert groups == 3 and video_tokens > 0
    client = gradio_client.Client(url, verbose=False)
    reply, answer, engine = ask(client, "", clip)
    assert reply == want and f"{video_tokens} of them from 1 video" in answer, answer
    before = caches(engine)
    follow_up = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    reply, answer, engine = ask(client, "And then?")
    assert reply == pipe.chat([follow_up])[0].text
    assert f"{video_tokens} of them from 1 video" in answer, answer
    assert cached_tokens(answer) > video_tokens  # the video's turn from the prefix cache: not encoded again
    assert caches(engine)["misses"] == before["misses"]
    fewer = ask(client, "And then?", video_max_frames=4)[1]
    assert re.search(r"(\d+) of them from 1 video", fewer).group(1) == str(video_tokens * 2 // 3), fewer


def test_corrupt_video_gets_an_error_reply_and_the_chat_goes_on(server, clip, tmp_path):
    url, _, _ = server
    broken = tmp_path / "broken.mp4"
    with open(clip, "rb") as good:
        broken.write_bytes(good.read()[:300])  # a truncated mp4
    client = gradio_client.Client(url, verbose=False)
    reply, answer, _ = ask(client, "What happens?", str(broken))
    assert reply["metadata"]["title"] == ERROR_TITLE and "'broken.mp4'" in reply["content"], reply
    assert "internal error" not in reply["content"] and str(tmp_path) not in reply["content"]
    assert "Not generated" in answer
    # The same chat goes on without the failed turn, with an image and then a good video.
    assert ask(client, "Describe this image.", sample("scene_4.png"))[0] == EXPECTED["scene_4.png"]
    assert "from 1 image and 1 video" in ask(client, "", clip)[1]


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
                         check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--concurrency" in bad.stderr and "Traceback" not in bad.stderr


def test_demo_engine_flags_reach_the_pipeline(monkeypatch, capsys):
    """`--tp`, `--vit-parallel` and `--quantization` become the Pipeline's settings; `--tp 0` is refused by name
    (EngineConfig), as one line and exit code 2, before any server starts."""
    from mmpipe.app.demo import main

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
    assert "prefix_caching" not in seen  # the engine's default
    seen.clear()
    assert main(["--device", "cpu", "--no-prefix-caching"]) == 2 and seen["prefix_caching"] is False
    monkeypatch.undo()
    assert main(["--device", "cpu", "--tp", "0"]) == 2
    assert "tensor_parallel_size=0: must be a positive integer" in capsys.readouterr().err
