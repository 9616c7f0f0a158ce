"""The demo in a real headless Chromium: upload, ask, watch the answer stream, stop it, retry,
read the statistics panels, take a screenshot, and check the page fetched nothing from the
network; upload an mp4, see it play in the chat and get answers about it. Skipped when Chromium or
playwright is missing (`.ci/run` installs both)."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from tests.demo_helpers import EXPECTED, StepRecorder, free_port, sample, wait_for

CHROMIUM = os.environ.get("MMPIPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"),
]
# Flags for a sandboxed machine: no background connections, no GPU, root without a sandbox.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
STEP_DELAY_S = 0.12  # a large model's pace, so there is time to press stop mid-answer


@pytest.fixture(scope="module")
def demo_url():
    pytest.importorskip("gradio")
    from mmpipe.app.demo_chat import ChatBackend
    from mmpipe.app.demo_page import launch

    from mmpipe import Pipeline

    pipe = Pipeline.from_pretrained(device="cpu")
    recorder = StepRecorder(STEP_DELAY_S).install(pipe)
    demo, url = launch(ChatBackend(pipe, concurrency=2), port=free_port(), block=False, quiet=True)
    yield url, recorder, pipe
    demo.close()
    pipe.close()


@pytest.fixture()
def page(demo_url):
    url = demo_url[0]
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.requests = []
        page.on("request", lambda r: page.requests.append(r.url))
        page.goto(url)
        page.wait_for_selector("#mmpipe-engine-stats", timeout=60_000)
        yield page
        browser.close()


def bot_text(page) -> str:
    messages = page.locator(".message.bot")
    return messages.last.inner_text().strip() if messages.count() else ""


def panel(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id}").inner_text()


def prompt_tokens(page) -> tuple[int, int] | None:
    """(prompt tokens, of them from the video) of a finished answer, from the answer panel."""
    text = panel(page, "mmpipe-answer-stats")
    found = re.search(r"Prompt\s+(\d+) tokens, (\d+) of them from 1 video", text)
    ended = re.search(r"Generated\s+\d+ tokens \((length|stop)\)", text)
    return (int(found.group(1)), int(found.group(2))) if found and ended else None


def test_upload_ask_stream_stop_retry_and_statistics(demo_url, page, tmp_path):
    recorder = demo_url[1]
    expected = EXPECTED["scene_5.png"]
    page.locator("input[type=file]").first.set_input_files(sample("scene_5.png"))
    page.wait_for_selector("[data-testid='multimodal-textbox'] img, .thumbnail-item img", timeout=30_000)
    page.get_by_placeholder("Ask about an image").fill("Describe this image.")
    page.keyboard.press("Enter")

    # Streamed: the answer is seen at several lengths, each a prefix of the full caption.
    seen: list[str] = []

    def grew() -> bool:
        text = bot_text(page)
        if text and text != "Loading content" and (not seen or text != seen[-1]):
            seen.append(text)
        return len(seen) >= 3

    wait_for(grew, 60, "the answer to stream")
    assert all(expected.startswith(t) for t in seen), seen
    aborts = recorder.aborts
    page.get_by_role("button", name="Stop").click()
    # Aborted at once (the answer would need seconds more to end by itself).
    wait_for(lambda: recorder.aborts == aborts + 1, 8 * STEP_DELAY_S, "the request to be aborted")
    time.sleep(6 * STEP_DELAY_S)
    stopped = bot_text(page)
    time.sleep(10 * STEP_DELAY_S)
    assert bot_text(page) == stopped, "the answer kept growing after stop"
    assert expected.startswith(stopped) and len(stopped) < len(expected), stopped

    wait_for(lambda: "(abort)" in panel(page, "mmpipe-answer-stats"), 10, "the panel to show the abort")
    answer = panel(page, "mmpipe-answer-stats")
    assert re.search(r"Time to first token\s+\d+ ms", answer), answer
    assert re.search(r"Decode speed\s+[\d.]+ tokens/s", answer), answer
    assert re.search(r"Prompt\s+\d+ tokens, \d+ of them from 1 image", answer), answer
    # The aborted request left the engine and gave its KV pages back (the engine panel refreshes itself).
    wait_for(lambda: re.search(r"0 running, 0 waiting", panel(page, "mmpipe-engine-stats")), 20, "engine idle")
    wait_for(lambda: re.search(r"KV pages\s+0 / \d+ used", panel(page, "mmpipe-engine-stats")), 20, "pages freed")

    # Retry regenerates the stopped answer, this time to the end.
    page.get_by_role("button", name="Retry").last.click()
    wait_for(lambda: bot_text(page) == expected, 60, "the retried answer")
    wait_for(lambda: "(stop)" in panel(page, "mmpipe-answer-stats"), 20, "the final statistics")
    # The seed field, as the page shows and sends it: empty (unseeded), not 0.
    page.get_by_text("Generation settings").click()
    seed = page.get_by_label("Seed (empty = random)")
    seed.wait_for(timeout=10_000)
    assert seed.input_value() == ""
    shot = tmp_path / "demo.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("MMPIPE_DEMO_SCREENSHOT"):
        shutil.copy(shot, os.environ["MMPIPE_DEMO_SCREENSHOT"])

    page.get_by_role("button", name="Clear").click()
    wait_for(lambda: page.locator(".message").count() == 0, 20, "the chat to clear")

    outside = [u for u in page.requests if not re.match(r"(https?|wss?)://(127\.0\.0\.1|localhost)[:/]", u)
               and not u.startswith(("data:", "blob:"))]
    assert not outside, f"the page fetched from the network: {outside[:5]}"


def test_video_upload_plays_in_the_chat_and_stays_in_the_conversation(demo_url, page, tmp_path):
    """An mp4 dropped in the box shows in the chat as a video player that has loaded the clip, the
    answer is the pipeline's for that video part, and a text-only follow-up still asks about it."""
    from tests.video_helpers import make_video

    pipe = demo_url[2]
    clip = make_video(tmp_path / "clip.mp4", 24, 64, 48, fps=8)  # 3 s, H.264
    first = [{"role": "user", "content": [{"type": "video", "video": clip},
                                          {"type": "text", "text": "What happens in this video?"}]}]
    want = pipe.chat([first])[0].text
    page.locator("input[type=file]").first.set_input_files(clip)
    page.wait_for_selector(".thumbnail-item", timeout=30_000)
    page.get_by_placeholder("Ask about an image").fill("What happens in this video?")
    page.keyboard.press("Enter")
    player = page.locator("#mmpipe-chat .message.user video")
    player.first.wait_for(timeout=30_000)
    # Loaded by the browser (metadata read, so it plays): the clip's own size and length.
    wait_for(lambda: player.first.evaluate("v => v.readyState") >= 1, 30, "the video to load")
    assert player.first.evaluate("v => [v.videoWidth, v.videoHeight, Math.round(v.duration), v.error]") == [
        64, 48, 3, None]
    wait_for(lambda: bot_text(page) == want, 60, "the answer about the video")
    wait_for(lambda: prompt_tokens(page), 20, "the final statistics")
    prompt, from_video = prompt_tokens(page)

    follow_up = first + [{"role": "assistant", "content": want}, {"role": "user", "content": "And then?"}]
    want = pipe.chat([follow_up])[0].text
    # The chat box (its placeholder is gone once the chat has a turn).
    page.get_by_role("group", name="Multimedia input field").locator("textarea").fill("And then?")
    page.keyboard.press("Enter")
    wait_for(lambda: page.locator(".message.bot").count() == 2 and bot_text(page) == want, 60, "the follow-up")
    assert player.count() == 1  # still shown, once
    # The follow-up's prompt: the first turn, its answer and the question, with the same video tokens.
    wait_for(lambda: (prompt_tokens(page) or (0, 0))[0] > prompt, 20, "the follow-up's statistics")
    assert prompt_tokens(page)[1] == from_video
