"""The engine's own types for one step: prefill chunks and their host inputs, image spans, the
results of a launched sampling step, and what the engine needs of a preprocessed image. Plain
data and numpy; model code reads them, the scheduler builds them, neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Sequence

import numpy as np

from mmpipe.engine.kv_pages import DUMMY_PAGE

if TYPE_CHECKING:  # annotations only: the engine's types do not import the request's module at run time
    from mmpipe.engine.request import Request


class ImageInput(Protocol):
    """A preprocessed image as the engine sees it (each model family's preprocessing makes one on
    the host; `ModelSpec.patches` turns a pack of them into the encoder's input on its device)."""

    key: str  # content hash (the encoder cache's key)
    grid_thw: tuple[int, int, int]

    @property
    def num_patches(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


class ImageSpan(NamedTuple):
    """Rows [row, row + len(values)) of a prefill step take these image embeddings."""

    row: int
    values: Any  # [tokens, hidden] tensor


@dataclass
class PrefillChunk:
    """Tokens [start, end) of a request's sequence, computed in one forward."""

    request: Request
    start: int
    end: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the end of the sequence, so its last row is sampled."""
        return self.end == self.request.total_len


@dataclass
class PrefillInputs:
    """The host side of one prefill forward, plain numpy; `upload` moves it to the device in one
    transfer."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [3, T] int64 (M-RoPE)
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: list[int]  # [B]: cached prefix + new tokens
    query_lens: list[int]  # [B]
    page_table: np.ndarray  # [B, P] int32
    logit_rows: np.ndarray  # [n] int64: rows whose logits are sampled (chunks that complete)
    images: list[ImageSpan]  # rows that take image embeddings, each image's span with its values

    @classmethod
    def build(cls, chunks: Sequence[PrefillChunk], page_size: int) -> "PrefillInputs":
        """The host inputs of one forward over `chunks` (each request holds the pages its chunk
        writes; padding columns of the page table point at the reserved page)."""
        token_ids, positions, slots, rows, images = [], [], [], [], []
        offset = 0
        for chunk in chunks:
            request, start, end = chunk.request, chunk.start, chunk.end
            token_ids.append(np.asarray(request.tokens(start, end), dtype=np.int64))
            positions.append(request.positions_of(start, end))
            index = np.arange(start, end, dtype=np.int64)
            pages = np.asarray(request.pages, dtype=np.int64)
            slots.append(pages[index // page_size] * page_size + index % page_size)
            for first, image, emb in zip(request.image_starts, request.images, request.image_embeds):
                lo, hi = max(start, first), min(end, first + image.num_tokens)
                if lo >= hi:
                    continue
                if emb is None:
                    raise RuntimeError("image rows scheduled before the image was encoded")
                images.append(ImageSpan(lo - start + offset, emb[lo - first:hi - first]))
            offset += end - start
            if chunk.completes:
                rows.append(offset - 1)
        seq_lens = [c.end for c in chunks]
        width = max(1, -(-max(seq_lens) // page_size))
        table = np.full((len(chunks), width), DUMMY_PAGE, dtype=np.int32)
        for i, chunk in enumerate(chunks):
            count = -(-chunk.end // page_size)
            table[i, :count] = chunk.request.pages[:count]
        if len(chunks) == 1:  # the common step of one chunk: no copies
            ids, pos, slot = token_ids[0], positions[0], slots[0]
        else:
            ids, pos, slot = np.concatenate(token_ids), np.concatenate(positions, axis=1), np.concatenate(slots)
        return cls(ids, pos, slot, seq_lens, [c.end - c.start for c in chunks], table,
                   np.asarray(rows, dtype=np.int64), images)


@dataclass
class DecodeOutput:
    """One step's results, in the order of the requests passed to `step`."""

    tokens: list[int]
    token_logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    def select(self, indices: list[int]) -> "DecodeOutput":
        """The results of these requests only, in this order."""
        pick = lambda values: [values[i] for i in indices] if values is not None else None  # noqa: E731
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
