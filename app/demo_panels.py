"""The demo's statistics panels, as markdown tables: this answer's time to first token, speed and
token counts; the shared engine's requests, KV pages, graphs and encoder cache."""

from __future__ import annotations

from typing import Any


def answer_panel(stream: Any, error: str | None = None, media: tuple[int, int] | None = None) -> str:
    """Markdown: this answer's time to first token, speed, and token counts. `media`: the
    conversation's (images, videos) (the engine counts a video's frame groups as images)."""
    if stream is None:
        return table("This answer", [("Not generated", error) if error else ("Status", "no answer yet")])
    metrics = stream.metrics()
    generated = stream.num_generated_tokens
    finish = stream.finish_reason
    images, videos = (stream.num_images, 0) if media is None else media
    sources, preparing = _media(images, videos), "images, videos" if videos else "images"
    rows = [
        ("Time to first token", f"{metrics.time_to_first_token_s * 1e3:.0f} ms from the request, of which "
                                f"{metrics.preprocess_s * 1e3:.0f} ms preparing it (template, {preparing})"
         if generated else "waiting"),
        ("Decode speed", f"{metrics.decode_tokens_per_s:.1f} tokens/s" if generated > 1 else "-"),
        ("Generated", f"{generated} tokens" + (f" ({finish})" if finish else " so far")),
        ("Prompt", f"{stream.num_prompt_tokens} tokens, {stream.num_image_tokens} of them from {sources}; "
                   f"{stream.num_cached_tokens} found in the prefix cache"),
        ("Queued", f"{metrics.queued_s * 1e3:.0f} ms"),
    ]
    return table("This answer", rows)


def engine_panel(pipe: Any) -> str:
    """Markdown: the shared engine's requests, KV pages, graphs, encoder cache and prefix cache."""
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
        ("Prefix cache", _prefix(stats["prefix_cache"])),
    ]
    return table("Engine", rows)


def _prefix(cache: dict[str, Any]) -> str:
    """'12 pages, 3 hits in 5 requests, 61% of prompt tokens from the cache'."""
    if not cache["enabled"]:
        return "off"
    return (f"{cache['cached_pages']} pages, {cache['hits']} hits in {cache['requests']} requests, "
            f"{cache['cached_share']:.0%} of prompt tokens from the cache")


def _media(images: int, videos: int) -> str:
    """'2 images', '1 video', '1 image and 1 video'."""
    named = [f"{n} {kind}{'s' if n != 1 else ''}" for n, kind in ((images, "image"), (videos, "video"))
             if n or kind == "image" and not videos]
    return " and ".join(named)


def _graphs(part: dict[str, Any]) -> str:
    if not part.get("enabled"):
        return "off"
    return (f"{part.get('graphs', 0)} live, {part.get('captures', 0)} captured, {part.get('replays', 0)} replays, "
            f"{part.get('memory_bytes', 0) / 2**20:.0f} MiB")


def table(title: str, rows: list[tuple[str, str]]) -> str:
    lines = [f"| {title} | |", "| --- | --- |"]
    lines += [f"| {name} | {value.replace('|', '&#124;')} |" for name, value in rows]
    return "\n".join(lines)
