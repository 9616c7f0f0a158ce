"""The browser demo: multimodal chat with streamed answers, a stop button and live statistics.

    mmpipe demo                                   # the bundled model, http://127.0.0.1:7860
    mmpipe demo --model ~/models/Qwen2.5-VL-3B-Instruct --concurrency 8 --port 8000
    python -m mmpipe.app.demo                     # the same (python -m app.demo from a checkout)

Built on Gradio's own chat components (`gr.ChatInterface(multimodal=True)`): several images per
turn, multi-turn history whose earlier images stay in the conversation (the encoder cache makes
them free to resend), retry / undo / clear, and a stop button that aborts the request and frees
its KV pages. Everyone who opens the page shares one Pipeline; up to `--concurrency` answers are
generated at once and the engine batches them together. A bad image gets an error reply in that
chat only. Nothing is fetched from the network: analytics are off and the fonts are Gradio's
bundled ones.

`ChatBackend` holds everything but the page (turning Gradio's history into a conversation,
streaming, the statistics panels), so it runs and is tested without Gradio.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from mmpipe.config import VIT_PARALLEL, VIT_PARALLEL_HELP, EngineConfig, GraphMode, SamplingParams
from mmpipe.errors import InputError, MmpipeError
from mmpipe.quantization import QUANTIZATION_HELP, RUNTIME_QUANTIZATIONS

log = logging.getLogger("mmpipe.demo")

ERROR_TITLE = "Error"  # metadata title of an error reply: such turns are left out of later prompts
IMAGE_ONLY_PROMPT = "Describe this image."  # the question when a turn has images but no text
UPDATE_INTERVAL_S = 0.05  # at most this often a streamed answer is pushed to the page
SESSIONS_KEPT = 1024  # sessions whose latest answer the stop panel can still show
SAMPLE_IMAGES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "images")


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

    @classmethod
    def from_inputs(cls, system_prompt: Any, max_new_tokens: Any, temperature: Any, top_p: Any, top_k: Any,
                    repetition_penalty: Any, seed: Any) -> "Settings":
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
                   seed=None if seed is None or seed == "" else number("seed", seed, int))

    def sampling(self) -> SamplingParams:
        """SamplingParams checks the ranges (it raises InputError naming the field)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, repetition_penalty=self.repetition_penalty, seed=self.seed)


def error_reply(message: str) -> dict[str, Any]:
    """An assistant message Gradio shows as a titled box; `to_conversation` skips its turn."""
    return {"role": "assistant", "content": message, "metadata": {"title": ERROR_TITLE}}


def to_conversation(message: Any, history: Sequence[dict[str, Any]], system_prompt: str = "") -> list[dict[str, Any]]:
    """Gradio's chat history plus the new message, as a conversation for `Pipeline.stream`.

    Accepts both shapes Gradio produces: the browser's (content a list of {"type": "text"} and
    {"type": "file", "file": {"path"}} items) and the API's ({"path"} dicts and strings). Turns
    answered by an error reply are dropped, so one bad image does not poison the rest of the chat.
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
    for turn in turns:  # a turn of images alone was answered as the caption question: replay it so
        if turn["role"] == "user" and all(i["type"] == "image" for i in turn["content"]):
            turn["content"].append({"type": "text", "text": IMAGE_ONLY_PROMPT})
    new = _new_message_items(message)
    if not new:
        raise InputError("the message is empty: type a question or attach an image")
    if turns and turns[-1]["role"] == "user":
        turns[-1]["content"].extend(new)
    else:
        turns.append({"role": "user", "content": new})
    if system_prompt:
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def _new_message_items(message: Any) -> list[dict[str, Any]]:
    if isinstance(message, str):
        return _content_items(message)
    if not isinstance(message, dict):
        raise InputError(f"the message must be text or {{'text', 'files'}}, got {type(message).__name__}")
    items = [item for f in message.get("files") or []
             for item in ([{"type": "image", "image": f}] if isinstance(f, str) else _content_items(f))]
    text = str(message.get("text") or "").strip()
    if not text and items:
        text = IMAGE_ONLY_PROMPT
    return items + ([{"type": "text", "text": text}] if text else [])


def _content_items(content: Any) -> list[dict[str, Any]]:
    """One message's content as conversation items (images first keep Gradio's order)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content.strip() else []
    if isinstance(content, (list, tuple)):
        if isinstance(content, tuple) and content and isinstance(content[0], str) and os.path.exists(content[0]):
            return [{"type": "image", "image": content[0]}]  # Gradio's (path, alt_text) form
        return [item for part in content for item in _content_items(part)]
    if isinstance(content, dict):
        if content.get("type") == "text" or ("text" in content and "path" not in content and "file" not in content):
            return _content_items(content.get("text"))
        path = content.get("path") or (content.get("file") or {}).get("path")
        if path:
            return [{"type": "image", "image": path}]
        return []
    path = getattr(content, "path", None)  # FileData objects
    return [{"type": "image", "image": path}] if isinstance(path, str) else []


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
                repetition_penalty: Any = None, seed: Any = None, session: str = "") -> Iterator[tuple[Any, str, str]]:
        """Yield (answer so far, answer statistics, engine statistics), at most every
        `update_interval_s` while streaming and once at the end. Closing the generator (Gradio's
        stop button) aborts the request. At most `concurrency` answers run at once; the others
        wait here (and can be stopped while they wait)."""
        while not self._slots.acquire(timeout=0.25):
            yield "", _table("This answer", [("Status", "waiting for a free slot")]), self.engine_panel()
        try:
            yield from self._respond(message, history, system_prompt, max_new_tokens, temperature, top_p, top_k,
                                     repetition_penalty, seed, session)
        finally:
            self._slots.release()

    def final_answer_panel(self, session: str, wait_s: float = 2.0) -> str | None:
        """The statistics of a session's latest answer once it has ended (after a stop, the abort
        lands a moment later)."""
        stream = self._last.get(session)
        if stream is None:
            return None
        deadline = time.monotonic() + wait_s
        while stream.finish_reason is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return answer_panel(stream)

    def _respond(self, message: Any, history: Sequence[dict[str, Any]], system_prompt: Any, max_new_tokens: Any,
                 temperature: Any, top_p: Any, top_k: Any, repetition_penalty: Any, seed: Any,
                 session: str) -> Iterator[tuple[Any, str, str]]:
        d = self.pipe.defaults
        try:
            settings = Settings.from_inputs(
                system_prompt, d.max_new_tokens if max_new_tokens is None else max_new_tokens,
                d.temperature if temperature is None else temperature, d.top_p if top_p is None else top_p,
                d.top_k if top_k is None else top_k,
                d.repetition_penalty if repetition_penalty is None else repetition_penalty, seed)
            conversation = to_conversation(message, history, settings.system_prompt)
            stream = self.pipe.stream(conversation, settings.sampling())
        except MmpipeError as exc:
            reason = _short_paths(str(exc))
            yield error_reply(reason), answer_panel(None, error=reason), self.engine_panel()
            return
        if session:
            self._last.pop(session, None)
            with self._last_lock:
                self._last[session] = stream
                self._last.move_to_end(session)
                while len(self._last) > SESSIONS_KEPT:
                    self._last.popitem(last=False)
            while len(self._last) > 1024:  # oldest sessions first
                self._last.pop(next(iter(self._last)))
        text = ""
        last_push = time.monotonic()
        try:
            with stream:
                for delta in stream:
                    text += delta
                    now = time.monotonic()
                    if now - last_push >= self.update_interval_s:
                        last_push = now
                        yield text, answer_panel(stream), self.engine_panel()
        except Exception as exc:  # a bug, not the user's input: say so in this chat, keep serving
            log.exception("answer failed")
            reason = _short_paths(f"internal error: {exc}")
            yield error_reply(reason), answer_panel(None, error=reason), self.engine_panel()
            return
        yield text, answer_panel(stream), self.engine_panel()

    def engine_panel(self) -> str:
        return engine_panel(self.pipe)


def answer_panel(stream: Any, error: str | None = None) -> str:
    """Markdown: this answer's time to first token, speed, and token counts."""
    if stream is None:
        return _table("This answer", [("Not generated", error) if error else ("Status", "no answer yet")])
    metrics = stream.metrics()
    generated = stream.num_generated_tokens
    finish = stream.finish_reason
    rows = [
        ("Time to first token", f"{metrics.time_to_first_token_s * 1e3:.0f} ms from the request, of which "
                                f"{metrics.preprocess_s * 1e3:.0f} ms preparing it (template, images)"
         if generated else "waiting"),
        ("Decode speed", f"{metrics.decode_tokens_per_s:.1f} tokens/s" if generated > 1 else "-"),
        ("Generated", f"{generated} tokens" + (f" ({finish})" if finish else " so far")),
        ("Prompt", f"{stream.num_prompt_tokens} tokens, {stream.num_image_tokens} of them from "
                   f"{stream.num_images} image{'s' if stream.num_images != 1 else ''}"),
        ("Queued", f"{metrics.queued_s * 1e3:.0f} ms"),
    ]
    return _table("This answer", rows)


def engine_panel(pipe: Any) -> str:
    """Markdown: the shared engine's requests, KV pages, graphs and encoder cache."""
    stats = pipe.stats()
    kv, requests, cache = stats["kv_pages"], stats["requests"], stats["encoder_cache"]
    used = kv["total"] - kv["free"]
    rows = [
        ("Device", f"{pipe.device}, {str(pipe.dtype).removeprefix('torch.')}"),
        ("Graph mode", stats["graph_mode"]),
        ("Requests", f"{requests['running']} running, {requests['waiting']} waiting"),
        ("KV pages", f"{used} / {kv['total']} used ({kv['page_size']} tokens each)"),
        ("ViT graphs", _graphs(stats["vit"])),
        ("Prefill graphs", _graphs(stats["prefill"])),
        ("Decode graphs", _graphs(stats["decode"])),
        ("Encoder cache", f"{cache['entries']} images, {cache['hits']} hits, {cache['misses']} misses"),
    ]
    return _table("Engine", rows)


def _graphs(part: dict[str, Any]) -> str:
    if not part.get("enabled"):
        return "off"
    return (f"{part.get('graphs', 0)} live, {part.get('captures', 0)} captured, {part.get('replays', 0)} replays, "
            f"{part.get('memory_bytes', 0) / 2**20:.0f} MiB")


def _table(title: str, rows: list[tuple[str, str]]) -> str:
    lines = [f"| {title} | |", "| --- | --- |"]
    lines += [f"| {name} | {value.replace('|', '&#124;')} |" for name, value in rows]
    return "\n".join(lines)


def _short_paths(message: str) -> str:
    """Uploads live under long temporary paths; the user knows them by file name."""
    return re.sub(r"'(/[^']*/)([^'/]+)'", r"'\2'", message)


# ---------------------------------------------------------------------- the page


def sample_examples(folder: str = SAMPLE_IMAGES) -> list[dict[str, Any]]:
    """Example turns from the bundled sample scenes (none if the folder is missing)."""
    if not os.path.isdir(folder):
        return []
    images = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(".png"))
    examples: list[dict[str, Any]] = [{"text": IMAGE_ONLY_PROMPT, "files": [p]} for p in images[:3]]
    if len(images) >= 2:
        examples.append({"text": "Describe these two images.", "files": images[:2]})
    return examples


def build_ui(backend: ChatBackend, title: str | None = None) -> Any:
    """The Gradio page around `backend` (imports gradio)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no telemetry or version check at launch
    import gradio as gr

    pipe, d = backend.pipe, backend.pipe.defaults
    name = title or os.path.basename(os.path.normpath(pipe.model.path))
    longest = max(1, min(pipe.runner.max_model_len, 8192))
    settings = [
        gr.Textbox("", label="System prompt", lines=2, placeholder="optional", render=False),
        gr.Slider(1, longest, value=min(d.max_new_tokens, longest), step=1, label="Max new tokens", render=False),
        # Ranges always hold the checkpoint's defaults (Instruct checkpoints ship e.g. top_p=0.001).
        gr.Slider(0.0, max(2.0, d.temperature), value=d.temperature, step=0.01, label="Temperature (0 = greedy)",
                  render=False),
        gr.Slider(min(0.01, d.top_p), 1.0, value=d.top_p, step=0.001, label="Top-p", render=False),
        gr.Slider(0, max(200, d.top_k), value=d.top_k, step=1, label="Top-k (0 = off)", render=False),
        gr.Slider(min(0.5, d.repetition_penalty), max(2.0, d.repetition_penalty), value=d.repetition_penalty,
                  step=0.01, label="Repetition penalty", render=False),
        # A text field: a Number field shows and sends 0 when left empty, which would seed every answer.
        gr.Textbox("", label="Seed (empty = random)", placeholder="random", max_lines=1, render=False),
    ]
    answer_md = gr.Markdown(answer_panel(None), elem_id="mmpipe-answer-stats", render=False)
    engine_md = gr.Markdown(backend.engine_panel(), elem_id="mmpipe-engine-stats", render=False)
    def respond(message: Any, history: list[dict[str, Any]], system_prompt: Any = "", max_new_tokens: Any = None,
                temperature: Any = None, top_p: Any = None, top_k: Any = None, repetition_penalty: Any = None,
                seed: Any = None, request: gr.Request = None) -> Iterator[Any]:
        yield from backend.respond(message, history, system_prompt, max_new_tokens, temperature, top_p, top_k,
                                   repetition_penalty, seed, session=getattr(request, "session_hash", "") or "")

    def after_stop(request: gr.Request) -> Any:
        panel = backend.final_answer_panel(getattr(request, "session_hash", "") or "")
        return gr.skip() if panel is None else panel

    # Gradio finds the request parameter by its type; this module's annotations are strings.
    respond.__annotations__["request"] = after_stop.__annotations__["request"] = gr.Request

    with gr.Blocks(title=f"mmpipe: {name}", analytics_enabled=False, fill_height=True) as demo:
        gr.Markdown(f"## mmpipe demo: {name}\nDrop images, ask about them, watch the answer stream. "
                    f"Running on {pipe.device} ({str(pipe.dtype).removeprefix('torch.')}).")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                chat = gr.ChatInterface(
                    respond, multimodal=True, analytics_enabled=False,
                    textbox=gr.MultimodalTextbox(file_types=["image"], file_count="multiple", sources=["upload"],
                                                 placeholder="Ask about an image, or drop images here",
                                                 stop_btn=True),
                    chatbot=gr.Chatbot(label=name, height=520, elem_id="mmpipe-chat", buttons=["copy", "copy_all"]),
                    additional_inputs=settings, additional_outputs=[answer_md, engine_md],
                    additional_inputs_accordion=gr.Accordion("Generation settings", open=False, render=False),
                    examples=[[example] for example in sample_examples()] or None, cache_examples=False, stop_btn=True,
                    concurrency_limit=backend.concurrency, api_name="chat", fill_height=True, autofocus=False)
            with gr.Column(scale=1, min_width=320):
                answer_md.render()
                engine_md.render()
        # After a stop the answer panel shows how the aborted answer ended.
        chat.textbox.stop(after_stop, None, answer_md, queue=False, show_progress="hidden", api_visibility="private")
        # The engine panel also follows other users' requests and the state after a stop.
        gr.Timer(2.0).tick(backend.engine_panel, None, engine_md, queue=False, show_progress="hidden",
                           api_visibility="private")
    demo.queue(default_concurrency_limit=backend.concurrency)
    return demo


def launch(backend: ChatBackend, host: str = "127.0.0.1", port: int = 7860, block: bool = True,
           quiet: bool = False) -> tuple[Any, str]:
    """Start the server; with block=False return (demo, url) while it serves on a thread.
    `backend.concurrency` answers run at once."""
    demo = build_ui(backend)
    _, url, _ = demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=quiet,
                            ssr_mode=False, share=False, allowed_paths=[SAMPLE_IMAGES], show_error=True)
    return demo, url


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--concurrency", type=int, default=4, help="answers generated at once (batched together)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the best available)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16, float32 (default: the checkpoint's)")
    parser.add_argument("--quantization", default=None, choices=list(RUNTIME_QUANTIZATIONS),
                        help=QUANTIZATION_HELP)
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallel: split the language model over this many GPUs (the device's and the "
                             "next ones)")
    parser.add_argument("--vit-parallel", default=None, choices=list(VIT_PARALLEL), help=VIT_PARALLEL_HELP)
    parser.add_argument("--graph-mode", default=None, choices=[m.value for m in GraphMode],
                        help="language-model CUDA graphs (default: full_and_piecewise on CUDA)")
    parser.add_argument("--min-pixels", type=int, default=None,
                        help="smallest image area in pixels (default: the checkpoint's)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help="largest image area in pixels (default: the checkpoint's); fewer image tokens")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        print(f"mmpipe demo: --concurrency must be at least 1, got {args.concurrency}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"mmpipe demo: --port {args.port} is not a port number", file=sys.stderr)
        return 2
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("mmpipe demo: gradio is not installed; run  pip install 'mmpipe[app]'", file=sys.stderr)
        return 2
    from mmpipe import Pipeline

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        # The engine must admit every concurrent answer at once so they are batched together.
        default_running = EngineConfig().max_running_requests
        options = {"max_running_requests": args.concurrency} if args.concurrency > default_running else {}
        if args.quantization:
            options["quantization"] = args.quantization
        if args.tp != 1:  # validated by EngineConfig
            options["tensor_parallel_size"] = args.tp
        if args.vit_parallel:
            options["vit_parallel"] = args.vit_parallel
        pipe = Pipeline.from_pretrained(args.model, device=args.device, dtype=args.dtype, graph_mode=args.graph_mode,
                                        min_pixels=args.min_pixels, max_pixels=args.max_pixels, **options)
    except MmpipeError as exc:
        print(f"mmpipe demo: {exc}", file=sys.stderr)
        return 2
    try:
        launch(ChatBackend(pipe, concurrency=args.concurrency), args.host, args.port)
    except OSError as exc:  # the port is taken, or the address is not ours
        print(f"mmpipe demo: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        pipe.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from mmpipe.cli import CommandParser

    parser = build_parser(CommandParser(prog="mmpipe demo", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
