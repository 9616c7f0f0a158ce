"""What captioning adds to a chat request: the one-image conversation, and the caption or the reason
there is none (shared by `Pipeline.caption`, `mmpipe caption` and the Ray Data stage)."""

from __future__ import annotations

import re
from typing import Any

from mmpipe.outputs import RequestOutput

DEFAULT_CAPTION_PROMPT = "Describe this image."
EMPTY_CAPTION = "the model returned an empty caption"


def caption_result(output: RequestOutput) -> tuple[str | None, str | None]:
    """(caption, error) of a captioning request: the answer stripped, or why there is none (an
    empty answer is an error: a caption file must never be silently empty)."""
    if not output.ok:
        return None, output.error
    text = output.text.strip()
    return (text, None) if text else (None, EMPTY_CAPTION)


def per_file_error(reason: str) -> str:
    """A captioning error without the request and image it came from, nor the source's own name
    (a path, or "bytes (N bytes)"): for a row or line that names the file itself."""
    return re.sub(r"^conversation \d+, image \d+: (image ('.*?'|bytes \(\d+ bytes\)): )?", "", reason)


def caption_conversation(image: Any, prompt: str | None = None) -> list[dict[str, Any]]:
    text = prompt or DEFAULT_CAPTION_PROMPT
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
