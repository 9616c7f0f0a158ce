"""The demo's Gradio page around a `ChatBackend`: the chat with multimodal input (images and videos,
shown in the chat: videos as players) and a stop button, the generation settings (video sampling
among them), the statistics panels, example turns from the bundled sample scenes, and
the server that serves it (analytics off, nothing fetched from the network)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from mmpipe.app.demo_chat import IMAGE_ONLY_PROMPT, ChatBackend
from mmpipe.app.demo_panels import answer_panel
from mmpipe.vision.video_sampling import FPS, MAX_FRAMES

from mmpipe.captioning import VIDEO_EXTENSIONS

# What the upload box takes: images, and videos by MIME type or by the extensions `mmpipe caption`
# reads as video (Python's MIME table misses some, e.g. .ts, .3gp).
UPLOAD_TYPES = ["image", "video", *VIDEO_EXTENSIONS]

SAMPLE_IMAGES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "images")


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
        # How a video is sampled (Qwen's defaults): fewer frames, fewer prompt tokens.
        gr.Slider(0.25, 8.0, value=FPS, step=0.25, label="Video frames per second", render=False),
        gr.Slider(2, MAX_FRAMES, value=MAX_FRAMES, step=2, label="Video max frames", render=False),
    ]
    answer_md = gr.Markdown(answer_panel(None), elem_id="mmpipe-answer-stats", render=False)
    engine_md = gr.Markdown(backend.engine_panel(), elem_id="mmpipe-engine-stats", render=False)
    def respond(message: Any, history: list[dict[str, Any]], system_prompt: Any = "", max_new_tokens: Any = None,
                temperature: Any = None, top_p: Any = None, top_k: Any = None, repetition_penalty: Any = None,
                seed: Any = None, video_fps: Any = None, video_max_frames: Any = None,
                request: gr.Request = None) -> Iterator[Any]:
        yield from backend.respond(message, history, system_prompt, max_new_tokens, temperature, top_p, top_k,
                                   repetition_penalty, seed, video_fps, video_max_frames,
                                   session=getattr(request, "session_hash", "") or "")

    def after_stop(request: gr.Request) -> Any:
        panel = backend.final_answer_panel(getattr(request, "session_hash", "") or "")
        return gr.skip() if panel is None else panel

    # Gradio finds the request parameter by its type; this module's annotations are strings.
    respond.__annotations__["request"] = after_stop.__annotations__["request"] = gr.Request

    with gr.Blocks(title=f"mmpipe: {name}", analytics_enabled=False, fill_height=True) as demo:
        gr.Markdown(f"## mmpipe demo: {name}\nDrop images or a video, ask about them, watch the answer stream. "
                    f"Running on {pipe.device} ({str(pipe.dtype).removeprefix('torch.')}).")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                chat = gr.ChatInterface(
                    respond, multimodal=True, analytics_enabled=False,
                    textbox=gr.MultimodalTextbox(file_types=UPLOAD_TYPES, file_count="multiple", sources=["upload"],
                                                 placeholder="Ask about an image or a video, or drop them here",
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
