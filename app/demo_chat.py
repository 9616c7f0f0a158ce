"""The demo's chat without the page: Gradio's history and the new message turned into a
conversation (uploads become image or video parts; turns answered by an error reply left out), the
page's settings checked, and `ChatBackend`, which streams answers on one shared Pipeline, at most
`concurrency` at once, and renders the statistics panels. It runs and is tested without Gradio."""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mmpipe.app.demo_panels import answer_panel, engine_panel, table
from mmpipe.vision.video_sampling import FPS, MAX_FRAMES

from mmpipe.captioning import DEFAULT_VIDEO_PROMPT, caption_video_options, is_video
from mmpipe.config import SamplingParams
from mmpipe.errors import InputError, MmpipeError

log = logging.getLogger("mmpipe.demo")

ERROR_TITLE = "Error"  # metadata title of an error reply: such turns are left out of later prompts
IMAGE_ONLY_PROMPT = "Describe this image."  # the question when a turn has images but no text
VIDEO_ONLY_PROMPT = DEFAULT_VIDEO_PROMPT  # ... and when it has a video but no text
TOO_LONG_HINT = ("; for a video, lower 'Video frames per second' or 'Video max frames' in the generation "
                 "settings")
UPDATE_INTERVAL_S = 0.05  # at most this often a streamed answer is pushed to the page
SESSIONS_KEPT = 1024  # sessions whose latest answer the stop panel can still show


@dataclass(frozen=True)
class Settings:
    """The page's generation settings, checked on the way in."""

    system_prompt: str = ""
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    video_fps: float = FPS  # frames sampled a second of video (Qwen's default)
    video_max_frames: int = MAX_FRAMES  # at most this many frames a video (Qwen's default)

    @classmethod
    def from_inputs(cls, system_prompt: Any, max_new_tokens: Any, temperature: Any, top_p: Any, top_k: Any,
                    repetition_penalty: Any, seed: Any, video_fps: Any = None,
                    video_max_frames: Any = None) -> Settings:
        def number(name: str, value: Any, kind: type) -> Any:
            try:
                out = float(value)
            except (TypeError, ValueError, OverflowError):
                raise InputError(f"{name}: {value!r} is not a number") from None
            if not math.isfinite(out):
                raise InputError(f"{name}: {value!r} is not a finite number")
            if kind is int:
                if out != int(out):
                    raise InputError(f"{name}: {value!r} is not a whole number")
                return int(out)
            return out

        if isinstance(seed, str):  # the page's seed field is text: blank means unseeded
            seed = seed.strip()
        return cls(system_prompt=str(system_prompt or "").strip(),
                   max_new_tokens=number("max new tokens", max_new_tokens, int),
                   temperature=number("temperature", temperature, float),
                   top_p=number("top-p", top_p, float),
                   top_k=number("top-k", top_k, int),
                   repetition_penalty=number("repetition penalty", repetition_penalty, float),
                   seed=None if seed is None or seed == "" else number("seed", seed, int),
                   video_fps=FPS if video_fps is None else number("video frames per second", video_fps, float),
                   video_max_frames=(MAX_FRAMES if video_max_frames is None
                                     else number("video max frames", video_max_frames, int)))

    def video(self) -> dict[str, Any]:
        """The keys every video part of the conversation gets (checked: InputError naming the key)."""
        return caption_video_options({"fps": self.video_fps, "max_frames": self.video_max_frames},
                                     where="video settings").given()

    def sampling(self) -> SamplingParams:
        """SamplingParams checks the ranges (it raises InputError naming the field)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, repetition_penalty=self.repetition_penalty, seed=self.seed)


def error_reply(message: str) -> dict[str, Any]:
    """An assistant message Gradio shows as a titled box; `to_conversation` skips its turn."""
    return {"role": "assistant", "content": message, "metadata": {"title": ERROR_TITLE}}


def to_conversation(message: Any, history: Sequence[dict[str, Any]], system_prompt: str = "",
                    video: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Gradio's chat history plus the new message, as a conversation for `Pipeline.stream`.

    Accepts both shapes Gradio produces: the browser's (content a list of {"type": "text"} and
    {"type": "file", "file": {"path", "mime_type"}} items) and the API's ({"path"} dicts and
    strings). An upload is a video part when its MIME type is video/* or its name ends in a video
    extension (`mmpipe.captioning.VIDEO_EXTENSIONS`), else an image part; every video part gets the
    keys in `video` (e.g. fps, max_frames), earlier turns' videos included. Turns answered by an
    error reply are dropped, so one bad upload does not poison the rest of the chat.
    """
    turns: list[dict[str, Any]] = []
    for msg in history:
        role = msg.get("role")
        if role == "assistant" and ((msg.get("metadata") or {}).get("title") == ERROR_TITLE):
            while turns and turns[-1]["role"] == "user":
                turns.pop()
            continue
        if role not in ("user", "assistant"):
            continue
        items = _content_items(msg.get("content"))
        if not items:
            continue
        if role == "assistant":  # the model sees its own earlier answers as text only
            items = [{"type": "text", "text": " ".join(i["text"] for i in items if i["type"] == "text")}]
        if turns and turns[-1]["role"] == role:  # Gradio may split one turn into several messages
            turns[-1]["content"].extend(items)
        else:
            turns.append({"role": role, "content": items})
    for turn in turns:  # a turn of uploads alone was answered as the caption question: replay it so
        if turn["role"] == "user" and all(i["type"] != "text" for i in turn["content"]):
            turn["content"].append({"type": "text", "text": _media_prompt(turn["content"])})
    new = _new_message_items(message)
    if not new:
        raise InputError("the message is empty: type a question or attach an image or a video")
    if turns and turns[-1]["role"] == "user":
        turns[-1]["content"].extend(new)
    else:
        turns.append({"role": "user", "content": new})
    if video:
        for turn in turns:
            turn["content"] = [{**i, **video} if i["type"] == "video" else i for i in turn["content"]]
    if system_prompt:
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def media_counts(conversation: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(images, videos) in a conversation built by `to_conversation`."""
    kinds = [i["type"] for m in conversation if isinstance(m["content"], list) for i in m["content"]]
    return kinds.count("image"), kinds.count("video")


def _media_prompt(items: Sequence[dict[str, Any]]) -> str:
    return VIDEO_ONLY_PROMPT if any(i["type"] == "video" for i in items) else IMAGE_ONLY_PROMPT


def _upload(path: str, mime_type: Any = None) -> dict[str, Any]:
    """An uploaded file as a video part or an image part."""
    if (isinstance(mime_type, str) and mime_type.startswith("video/")) or is_video(path):
        return {"type": "video", "video": path}
    return {"type": "image", "image": path}


def _new_message_items(message: Any) -> list[dict[str, Any]]:
    if isinstance(message, str):
        return _content_items(message)
    if not isinstance(message, dict):
        raise InputError(f"the message must be text or {{'text', 'files'}}, got {type(message).__name__}")
    items = [item for f in message.get("files") or []
             for item in ([_upload(f)] if isinstance(f, str) else _content_items(f))]
    text = str(message.get("text") or "").strip()
    if not text and items:
        text = _media_prompt(items)
    return items + ([{"type": "text", "text": text}] if text else [])


def _content_items(content: Any) -> list[dict[str, Any]]:
    """One message's content as conversation items (images first keep Gradio's order)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content.strip() else []
    if isinstance(content, (list, tuple)):
        if isinstance(content, tuple) and content and isinstance(content[0], str) and os.path.exists(content[0]):
            return [_upload(content[0])]  # Gradio's (path, alt_text) form
        return [item for part in content for item in _content_items(part)]
    if isinstance(content, dict):
        if content.get("type") == "text" or ("text" in content and "path" not in content and "file" not in content):
            return _content_items(content.get("text"))
        file = content.get("file") or {}
        path = content.get("path") or file.get("path")
        if path:
            return [_upload(path, content.get("mime_type") or file.get("mime_type"))]
        return []
    path = getattr(content, "path", None)  # FileData objects
    return [_upload(path, getattr(content, "mime_type", None))] if isinstance(path, str) else []


class ChatBackend:
    """Answers chat turns on one shared Pipeline and renders the statistics panels."""

    def __init__(self, pipe: Any, update_interval_s: float = UPDATE_INTERVAL_S, concurrency: int = 4) -> None:
        self.pipe = pipe
        self.update_interval_s = update_interval_s
        # Gradio gives the page's events and the API endpoint separate limits; this one holds for all.
        self.concurrency = concurrency
        self._slots = threading.BoundedSemaphore(concurrency)
        # session -> its latest stream, for the panel after a stop; the most recent sessions only
        # (a server answers many users over its life: a dict of every one would only grow).
        self._last: OrderedDict[str, Any] = OrderedDict()
        self._last_lock = threading.Lock()

    def respond(self, message: Any, history: Sequence[dict[str, Any]], system_prompt: Any = "",
                max_new_tokens: Any = None, temperature: Any = None, top_p: Any = None, top_k: Any = None,
                repetition_penalty: Any = None, seed: Any = None, video_fps: Any = None, video_max_frames: Any = None,
                session: str = "") -> Iterator[tuple[Any, str, str]]:
        """Yield (answer so far, answer statistics, engine statistics), at most every
        `update_interval_s` while streaming and once at the end. Closing the generator (Gradio's
        stop button) aborts the request. At most `concurrency` answers run at once; the others
        wait here (and can be stopped while they wait)."""
        while not self._slots.acquire(timeout=0.25):
            yield "", table("This answer", [("Status", "waiting for a free slot")]), self.engine_panel()
        try:
            yield from self._respond(message, history, system_prompt, max_new_tokens, temperature, top_p, top_k,
                                     repetition_penalty, seed, video_fps, video_max_frames, session)
        finally:
            self._slots.release()

    def final_answer_panel(self, session: str, wait_s: float = 2.0) -> str | None:
        """The statistics of a session's latest answer once it has ended (after a stop, the abort
        lands a moment later)."""
        last = self._last.get(session)
        if last is None:
            return None
        stream, media = last
        deadline = time.monotonic() + wait_s
        while stream.finish_reason is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return answer_panel(stream, media=media)

    def _respond(self, message: Any, history: Sequence[dict[str, Any]], system_prompt: Any, max_new_tokens: Any,
                 temperature: Any, top_p: Any, top_k: Any, repetition_penalty: Any, seed: Any, video_fps: Any,
                 video_max_frames: Any, session: str) -> Iterator[tuple[Any, str, str]]:
        d = self.pipe.defaults
        conversation: list[dict[str, Any]] | None = None
        try:
            settings = Settings.from_inputs(
                system_prompt, d.max_new_tokens if max_new_tokens is None else max_new_tokens,
                d.temperature if temperature is None else temperature, d.top_p if top_p is None else top_p,
                d.top_k if top_k is None else top_k,
                d.repetition_penalty if repetition_penalty is None else repetition_penalty, seed, video_fps,
                video_max_frames)
            conversation = to_conversation(message, history, settings.system_prompt, settings.video())
            stream = self.pipe.stream(conversation, settings.sampling())
        except MmpipeError as exc:
            reason = _short_paths(str(exc))
            if "max_model_len" in reason and conversation and media_counts(conversation)[1]:
                reason += TOO_LONG_HINT
            yield error_reply(reason), answer_panel(None, error=reason), self.engine_panel()
            return
        media = media_counts(conversation)
        if session:
            with self._last_lock:
                self._last.pop(session, None)
                self._last[session] = (stream, media)
                while len(self._last) > SESSIONS_KEPT:  # oldest sessions first
                    self._last.popitem(last=False)
        text = ""
        last_push = time.monotonic()
        try:
            with stream:
                for delta in stream:
                    text += delta
                    now = time.monotonic()
                    if now - last_push >= self.update_interval_s:
                        last_push = now
                        yield text, answer_panel(stream, media=media), self.engine_panel()
        except Exception as exc:  # a bug, not the user's input: say so in this chat, keep serving
            log.exception("answer failed")
            reason = _short_paths(f"internal error: {exc}")
            yield error_reply(reason), answer_panel(None, error=reason), self.engine_panel()
            return
        yield text, answer_panel(stream, media=media), self.engine_panel()

    def engine_panel(self) -> str:
        return engine_panel(self.pipe)


def _short_paths(message: str) -> str:
    """Uploads live under long temporary paths; the user knows them by file name."""
    return re.sub(r"'(/[^']*/)([^'/]+)'", r"'\2'", message)
