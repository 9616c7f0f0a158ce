"""`mmpipe serve` driven by the real `openai` client against a real uvicorn server on loopback, with
the bundled model on the CPU."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from mmpipe.app.serve import on_loopback as serving
from mmpipe.app.serve_api import create_app

from mmpipe import Pipeline, SamplingParams
from tests.engine_helpers import idle
from tests.video_helpers import make_video

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENE = os.path.join(REPO, "assets", "images", "scene_0.png")
KEY = "test-key"


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    shutil.copy(SCENE, folder / "scene.png")
    make_video(folder / "clip.mp4", 8, 64, 48)
    return folder


@pytest.fixture(scope="module")
def base(engine, media):
    app = create_app(engine, served_model_name="tiny", api_key=KEY, allowed_local_media_path=str(media))
    with serving(app) as url:
        yield url


@pytest.fixture
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _data_uri(path: str, mime: str = "image/png") -> str:
    with open(path, "rb") as f:
        return f"data:{mime};base64," + base64.b64encode(f.read()).decode()


def _image_message(url: str, text: str = "Describe this image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def test_chat_with_an_image_equals_the_python_api_greedy(client, pipe):
    messages = _image_message(_data_uri(SCENE))
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    ours = pipe.chat(messages, SamplingParams(max_new_tokens=24, temperature=0))[0]
    choice = reply.choices[0]
    assert choice.message.content == ours.text and ours.text
    assert choice.finish_reason == ("length" if len(ours.token_ids) == 24 else "stop")
    assert reply.usage.prompt_tokens == ours.num_prompt_tokens
    assert reply.usage.completion_tokens == len(ours.token_ids)
    assert reply.model == "tiny"


def test_streamed_chat_joins_to_the_whole_answer_and_reports_usage(client):
    messages = _image_message(_data_uri(SCENE))
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_the_cached_prompt_tokens_each_salt_apart(client):
    """OpenAI's `prompt_tokens_details.cached_tokens`; vLLM's `cache_salt` in the body."""
    messages = _image_message(_data_uri(SCENE), "Which objects are there?")

    def cached(salt: str, stream: bool = False) -> int:
        options = dict(model="tiny", messages=messages, max_tokens=2, extra_body={"cache_salt": salt})
        if stream:
            chunks = list(client.chat.completions.create(**options, stream=True,
                                                         stream_options={"include_usage": True}))
            return chunks[-1].usage.prompt_tokens_details.cached_tokens
        return client.chat.completions.create(**options).usage.prompt_tokens_details.cached_tokens

    first = cached("usage-test-a")
    assert first == 0  # nothing was cached under this salt
    assert cached("usage-test-a") > 0 and cached("usage-test-a", stream=True) > 0
    assert cached("usage-test-b", stream=True) == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body={"cache_salt": 7})


def test_a_local_video_and_a_local_image_under_the_allowed_folder(client, media):
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(media / "clip.mp4")}},
                                          {"type": "text", "text": "Describe this video."}]}]
    reply = client.chat.completions.create(model="tiny", messages=video, max_tokens=8)
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 20
    streamed = client.chat.completions.create(model="tiny", messages=video, max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply.choices[0].message.content
    image = client.chat.completions.create(model="tiny", messages=_image_message("file://" + str(media / "scene.png")),
                                           max_tokens=8)
    assert image.choices[0].message.content


def test_n_seed_stop_and_logprobs(client):
    messages = _image_message(_data_uri(SCENE))
    story = [{"role": "user", "content": "Tell me a story."}]  # the tiny model is unsure here
    sampled = {"model": "tiny", "messages": story, "max_tokens": 16, "temperature": 2.0, "seed": 7}
    two = client.chat.completions.create(n=2, **sampled)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content != two.choices[1].message.content
    again = client.chat.completions.create(n=2, **sampled)
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]
    other = client.chat.completions.create(**{**sampled, "seed": 8})
    assert other.choices[0].message.content != two.choices[0].message.content

    greedy = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=3)
    text = greedy.choices[0].message.content
    content = greedy.choices[0].logprobs.content
    assert len(content) == greedy.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.token == e.top_logprobs[0].token and e.logprob <= 0 for e in content)  # greedy: the top one
    word = text.split()[1]
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stop=[word])
    assert cut.choices[0].message.content == text[:text.index(word)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("knob, value", [("top_p", 0.3), ("top_k", 3), ("min_p", 0.3), ("repetition_penalty", 1.8),
                                         ("min_tokens", 24)])
def test_each_sampling_field_reaches_the_sampler(client, pipe, knob, value):
    """vLLM's sampling fields in the body (top_k, min_p, repetition_penalty, min_tokens) and
    OpenAI's (top_p, max_completion_tokens): a seeded sampled answer equals the Python API's with
    the same setting, and the setting changes it (so one the server dropped would show)."""
    story = [{"role": "user", "content": "Tell me a story."}]  # the tiny model is unsure here
    field = {"min_tokens": "min_new_tokens"}.get(knob, knob)
    reply = client.chat.completions.create(model="tiny", messages=story, max_completion_tokens=24, temperature=1.5,
                                           seed=5, **({"top_p": value} if knob == "top_p" else {}),
                                           extra_body={} if knob == "top_p" else {knob: value})
    ours = pipe.chat(story, SamplingParams(max_new_tokens=24, temperature=1.5, seed=5, **{field: value}))[0]
    plain = pipe.chat(story, SamplingParams(max_new_tokens=24, temperature=1.5, seed=5))[0]
    assert reply.choices[0].message.content == ours.text and reply.usage.completion_tokens == len(ours.token_ids)
    assert ours.token_ids != plain.token_ids


def test_streamed_choices_and_videos_as_data_uris(client, media):
    """n=2 streamed: each chunk names its choice, and each choice's chunks join to the answer the
    whole response gives; a video sent as a data URI is read like the file, and one that is not a
    video is refused (400, naming the part)."""
    story = [{"role": "user", "content": "Tell me a story."}]
    sampled = {"model": "tiny", "messages": story, "max_tokens": 12, "temperature": 2.0, "seed": 3, "n": 2}
    whole = client.chat.completions.create(**sampled)
    parts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **sampled):
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
    assert [parts[0], parts[1]] == [c.message.content for c in whole.choices] and parts[0] != parts[1]

    def video(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "Describe this video."}]}]

    as_file = client.chat.completions.create(model="tiny", messages=video(str(media / "clip.mp4")), max_tokens=8,
                                             temperature=0)
    as_data = client.chat.completions.create(model="tiny", messages=video(_data_uri(str(media / "clip.mp4"), "video/mp4")),
                                             max_tokens=8, temperature=0)
    assert as_data.choices[0].message.content == as_file.choices[0].message.content
    assert as_data.usage.prompt_tokens == as_file.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=video(_data_uri(SCENE, "video/mp4")), max_tokens=4)
    assert info.value.status_code == 400 and "video" in info.value.body["message"]


def test_completions_and_models_and_health(client, base, pipe):
    prompts = ["<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "A photo of"]
    reply = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, n=2, logprobs=2)
    ours = pipe.generate(prompts, sampling=SamplingParams(max_new_tokens=8, temperature=0))
    assert [c.text for c in reply.choices] == [ours[0].text] * 2 + [ours[1].text] * 2
    assert len(reply.choices[0].logprobs.tokens) == len(ours[0].token_ids)
    assert reply.usage.prompt_tokens == ours[0].num_prompt_tokens + ours[1].num_prompt_tokens
    streamed = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ours[1].text
    echoed = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[1] + ours[1].text
    streamed = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=8, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompts[1] + ours[1].text
    assert [m.id for m in client.models.list()] == ["tiny"]
    with urllib.request.urlopen(base + "/health") as r:
        assert r.status == 200


def test_the_checkpoints_generation_config_fills_what_a_request_leaves_out(checkpoint_factory):
    """A body without max_tokens or temperature gets generation_config.json's; one that sets them
    overrides it."""
    path = checkpoint_factory(generation={"do_sample": True, "temperature": 0.7, "top_k": 5, "max_new_tokens": 7})
    with Pipeline.from_pretrained(path, device="cpu") as local, serving(create_app(local, served_model_name="g")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        story = [{"role": "user", "content": "Tell me a story."}]
        left_out = client.chat.completions.create(model="g", messages=story, seed=4, extra_body={"ignore_eos": True})
        ours = local.chat(story, SamplingParams(seed=4, ignore_eos=True))[0]  # the defaults: 0.7, top-k 5, 7 tokens
        assert left_out.usage.completion_tokens == 7 and left_out.choices[0].message.content == ours.text
        greedy = client.chat.completions.create(model="g", messages=story, max_tokens=3, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert greedy.usage.completion_tokens == 3
        assert greedy.choices[0].message.content == local.chat(story, SamplingParams(
            max_new_tokens=3, temperature=0, ignore_eos=True))[0].text


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}],
     "messages", "network URLs"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/hostname"}}]}],
     "messages", "not under the allowed"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "messages", "image"),
    ([{"role": "robot", "content": "hi"}], "messages", "role"),
    ([], "messages", "non-empty"),
])
def test_bad_requests_are_400_with_an_openai_error(client, messages, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_unknown_model_long_prompt_bad_json_key_and_unknown_route(client, base, engine):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 3000}])
    assert "max_model_len" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    request = urllib.request.Request(base + "/v1/chat/completions", data=b"{not json", method="POST",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request)
    assert http.value.code == 400 and b'"invalid_request_error"' in http.value.read()
    stranger = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    with pytest.raises(urllib.error.HTTPError) as http:  # no key at all (the client always sends one)
        urllib.request.urlopen(base + "/v1/models")
    assert http.value.code == 401 and b'"authentication_error"' in http.value.read()
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(urllib.request.Request(base + "/v1/nothing-here",
                                                      headers={"Authorization": f"Bearer {KEY}"}))
    assert http.value.code == 404 and b'"error"' in http.value.read()
    assert idle(engine)  # no failed request kept pages


def test_bad_requests_leave_a_running_stream_alone(client, base, pipe, engine):
    """While a greedy stream runs, an unreadable image, an unknown model, a prompt over
    max_model_len and a body that is not JSON are each answered 400; the stream's answer is the
    one it gives alone."""
    messages = _image_message(_data_uri(SCENE))
    alone = pipe.chat(messages, SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True))[0]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=300, temperature=0,
                                            extra_body={"ignore_eos": True}, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].delta.content or ""
    refused = []
    for kwargs in ({"model": "tiny", "messages": _image_message("data:image/png;base64,AAAA")},
                   {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]},
                   {"model": "tiny", "messages": [{"role": "user", "content": "word " * 3000}]}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(max_tokens=4, **kwargs)
        refused.append(info.value.status_code)
    request = urllib.request.Request(base + "/v1/chat/completions", data=b"{not json", method="POST",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request)
    refused.append(http.value.code)
    stats = engine.stats()
    assert stats["kv_pages"]["free"] < stats["kv_pages"]["total"]  # the stream was still generating
    text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert refused == [400] * 4
    assert text == alone.text
    assert idle(engine)


def test_a_client_that_disconnects_mid_stream_frees_its_pages(client, engine):
    before = engine.stats()["runner"]["decode_tokens"]
    stream = client.chat.completions.create(model="tiny", messages=_image_message(_data_uri(SCENE)),
                                            max_tokens=1500, extra_body={"ignore_eos": True}, stream=True)
    for pieces, _ in enumerate(stream, 1):
        if pieces == 5:
            break
    stats = engine.stats()
    assert stats["kv_pages"]["free"] < stats["kv_pages"]["total"]  # it is still generating
    stream.close()
    assert idle(engine), "the aborted request kept its KV pages"
    # Stopped, not run to its end (which a fast machine could reach within idle's wait).
    assert engine.stats()["runner"]["decode_tokens"] - before < 1000


def test_the_engine_process_froze_its_start_up_heap(engine_process):
    """The engine process's start-up objects are out of the collector's view: a full collection
    there would walk them all, a pause under whatever request is streaming."""
    assert engine_process.call("tests.engine_helpers:frozen_objects") > 50_000


@pytest.mark.slow
def test_a_tensor_parallel_engine_process_serves_the_same_tokens(pipe):
    """The engine process starts the tensor-parallel workers (processes of its own) and serves
    their tokens; closing it ends them too."""
    from mmpipe.app.serve_engine import EngineProcess

    engine = EngineProcess(device="cpu", tensor_parallel_size=2)
    try:
        with serving(create_app(engine, served_model_name="tiny")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            messages = _image_message(_data_uri(SCENE))
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            assert engine.stats()["tensor_parallel"]["size"] == 2
            workers = _children(engine._process.pid)
            assert workers  # the rank-1 worker (and multiprocessing's own helpers)
    finally:
        engine.close()
    deadline = time.monotonic() + 10
    while [pid for pid in workers if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _alive(pid)], "a worker outlived the engine process"
    assert reply.choices[0].message.content == pipe.chat(messages, SamplingParams(max_new_tokens=12,
                                                                                  temperature=0))[0].text


def test_past_the_queue_the_server_answers_503_with_retry_after(pipe):
    app = create_app(pipe, served_model_name="tiny", max_queued=0, max_running=1)
    with serving(app) as url:  # admission is the app's: the engine's own process changes nothing here
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        long = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=1500, extra_body={"ignore_eos": True}, stream=True)
        next(iter(long))
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
        long.close()
        assert idle(pipe)
        deadline = time.monotonic() + 10
        while True:  # the slot comes back once the aborted request's thread has ended
            try:
                assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2).choices
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def test_concurrent_streams_batch_together_and_equal_each_alone(client, pipe, engine):
    prompts = [f"Tell me about scene {i}." for i in range(8)]
    alone = [pipe.chat([{"role": "user", "content": p}], SamplingParams(max_new_tokens=12, temperature=0))[0].text
             for p in prompts]
    steps = engine.stats()["steps"]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=12, temperature=0, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in chunks)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(8)] == alone
    assert engine.stats()["steps"] - steps < 8 * 12  # batched: fewer steps than one request after another


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def _command(*flags: str):
    """`mmpipe serve` (the bundled model on the CPU) as a process; yields (process, base URL) once
    /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mmpipe.cli", "serve", "--device", "cpu", "--port", str(port),
                             *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
                time.sleep(0.1)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_the_command_serves_and_sigterm_aborts_closes_the_pipeline_and_its_process():
    with _command() as (proc, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="mmpipe-tiny-scenes", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4).choices
        engines = _children(proc.pid)
        assert engines, "the Pipeline runs in a process of its own"
        long = client.chat.completions.create(model="mmpipe-tiny-scenes", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=1500, extra_body={"ignore_eos": True}, stream=True)
        chunks = iter(long)
        next(chunks)  # running when the signal comes
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "pipeline closed" in out, out
        received, ended = 1, None  # the open stream ends (its request aborted), never hangs
        try:
            for chunk in chunks:
                received += 1
                ended = chunk.choices[0].finish_reason if chunk.choices else ended
        except openai.APIError as exc:  # the connection cut as the server exits
            ended = type(exc).__name__
        assert ended is not None and received < 1500, (ended, received)
        deadline = time.monotonic() + 10  # multiprocessing's resource tracker ends just after its parent
        while [pid for pid in engines if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in engines if _alive(pid)], "the engine's process outlived the server"


@pytest.mark.slow
def test_the_engine_process_dying_fails_open_streams_and_stops_the_command():
    with _command() as (proc, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        long = client.chat.completions.create(model="mmpipe-tiny-scenes", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=1500, extra_body={"ignore_eos": True}, stream=True)
        chunks = iter(long)
        next(chunks)
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process ended"):
            for _ in chunks:
                pass
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "the engine process ended" in out, out


def test_engine_flags_become_the_pipeline_options():
    from mmpipe.app.serve import build_parser, engine_options

    assert engine_options(build_parser().parse_args(["--no-prefix-caching", "--batch-size", "8"])) == {
        "device": None, "dtype": None, "graph_mode": None, "min_pixels": None, "max_pixels": None,
        "max_running_requests": 8, "prefix_caching": False}
    assert "prefix_caching" not in engine_options(build_parser().parse_args([]))  # the engine's default
