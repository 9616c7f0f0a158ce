"""The token counts whose prefill pieces are captured as CUDA graphs at start-up.

Graphs save a forward's host launches, which matter most for short prompts, where a forward's GPU
time hardly depends on its length; each size costs a capture of every piece at start-up. So the
default schedule is dense where prompts are short (sizes spaced by at most a quarter above 256,
so padding costs a step at most about a quarter) and every 512 tokens above 2048, where a stream
of large steps (captioning packs thousands of prompt tokens per step) would otherwise queue
behind each eager forward's launches. It stops at 8192 tokens: a larger step budget keeps the
start-up time and graph memory of 8192 (the pool holds the largest size's activations for the
process's life), and its larger steps run the pieces without graphs. The sizes were chosen by
measurement; see docs/performance.md.
"""

from __future__ import annotations

STARTUP_PREFILL_SIZES = (8, 16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536,
                         1792, 2048)
LARGE_PREFILL_STEP = 512  # above the last of STARTUP_PREFILL_SIZES
LARGEST_DEFAULT_PREFILL_GRAPH = 8192


def default_prefill_schedule(max_tokens: int) -> list[int]:
    """Token counts captured by default: `STARTUP_PREFILL_SIZES`, then every `LARGE_PREFILL_STEP`
    tokens above 2048, up to `max_tokens` (at most `LARGEST_DEFAULT_PREFILL_GRAPH`), which is added
    as the last size, so every prefill step of a budget up to 8192 tokens has a graph."""
    top = min(max_tokens, LARGEST_DEFAULT_PREFILL_GRAPH)
    sizes = [s for s in STARTUP_PREFILL_SIZES if s <= top]
    sizes += range(STARTUP_PREFILL_SIZES[-1] + LARGE_PREFILL_STEP, top + 1, LARGE_PREFILL_STEP)
    if not sizes or sizes[-1] < top:
        sizes.append(top)
    return sizes


def fine_prefill_schedule(max_tokens: int) -> list[int]:
    """SGLang's schedule, denser and about twice the captures (pass it as `GraphConfig(buckets=...)`
    to capture it): 4-32 step 4, 48-256 step 16, 288-512 step 32, 576-1024 step 64, 1280-4096 step
    256, then step 512; capped by `max_tokens`, which is added as the last size."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256)]
    size = 4608
    while size <= max_tokens:
        sizes.append(size)
        size += 512
    sizes = [s for s in sizes if s <= max_tokens]
    if not sizes or sizes[-1] < max_tokens:
        sizes.append(max_tokens)
    return sizes
