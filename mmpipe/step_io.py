"""What one model step reads and returns, shared by the engine (which builds the inputs and reads
the results) and the model runners (which consume them): the rows of a prefill step that take image
embeddings, a prefill forward's host inputs, a launched sampling step's results, and the KV page
reserved for padding; and where a prompt's images and videos lie for its rotary positions. Plain
data and numpy; it imports nothing of mmpipe, so both rooms can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

# The KV page no sequence is given: padded rows of a batch write their K/V there.
DUMMY_PAGE = 0


@dataclass(frozen=True)
class VisualRun:
    """The tokens of one image or video in a prompt: where they start, the grid in patches, and
    the temporal interval between frame groups (float32; see `temporal_interval`)."""

    start: int
    grid: tuple[int, int, int]
    time_interval: float = 1.0


def temporal_interval(tokens_per_second: float, seconds_per_group: float) -> float:
    """Qwen2.5-VL's temporal position step between frame groups, float32(tokens_per_second x
    seconds a group spans), as transformers computes it from the checkpoint's tokens_per_second and
    the processor's float32 `second_per_grid_ts`."""
    return float(np.float32(tokens_per_second) * np.float32(seconds_per_group))


class ImageSpan(NamedTuple):
    """Rows [row, row + len(values)) of a prefill step take these image embeddings."""

    row: int
    values: Any  # [tokens, hidden] tensor


@dataclass
class PrefillInputs:
    """The host side of one prefill forward, plain numpy (the prefill runner moves it to the device
    in one transfer)."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [3, T] int64 (M-RoPE)
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: list[int]  # [B]: cached prefix + new tokens
    query_lens: list[int]  # [B]
    page_table: np.ndarray  # [B, P] int32
    logit_rows: np.ndarray  # [n] int64: rows whose logits are sampled (chunks that complete)
    images: list[ImageSpan]  # rows that take image embeddings, each image's span with its values


@dataclass
class DecodeOutput:
    """One step's results, in the order of the requests passed to `step`."""

    tokens: list[int]
    token_logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    def select(self, indices: list[int]) -> DecodeOutput:
        """The results of these requests only, in this order."""
        pick = lambda values: [values[i] for i in indices] if values is not None else None
        return DecodeOutput(pick(self.tokens), pick(self.token_logprobs), pick(self.top_ids),  # type: ignore[arg-type]
                            pick(self.top_logprobs))


class PendingDecode:
    """A launched sampling step (decode, or after a prefill); `get()` waits for its tokens (the
    sampler's host copy, `tokens.get() -> (ids, logprobs)`) and returns them in request order."""

    def __init__(self, tokens: Any, rows: np.ndarray) -> None:
        self.tokens, self.rows = tokens, rows

    def get(self) -> DecodeOutput:
        ids, lps = self.tokens.get()
        order = self.rows.tolist()
        if lps is None:
            return DecodeOutput([ids[r][0] for r in order])
        return DecodeOutput([ids[r][0] for r in order], [lps[r][0] for r in order], [ids[r][1:] for r in order],
                            [lps[r][1:] for r in order])
