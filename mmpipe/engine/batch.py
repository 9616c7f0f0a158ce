"""The engine's own types for one step: prefill chunks, what the engine needs of a preprocessed
image, and the host inputs of a prefill forward built from chunks (`mmpipe.step_io` holds the types
the model runners read too). Plain data and numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from mmpipe.step_io import DUMMY_PAGE, ImageSpan, PrefillInputs

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


@runtime_checkable
class VideoInput(Protocol):
    """A preprocessed video as the engine sees it: frame groups the tower encodes like images,
    and what its prompt tokens and positions need (`ModelSpec.video_time` says which)."""

    groups: list[ImageInput]
    grid_thw: tuple[int, int, int]

    @property
    def timestamps(self) -> list[float]: ...

    @property
    def seconds_per_group(self) -> float: ...


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


def build_prefill_inputs(chunks: Sequence[PrefillChunk], page_size: int) -> PrefillInputs:
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
    return PrefillInputs(ids, pos, slot, seq_lens, [c.end - c.start for c in chunks], table,
                         np.asarray(rows, dtype=np.int64), images)
