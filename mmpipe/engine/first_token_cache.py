"""The first token of a prompt seen before, without a forward.

With prefix caching, an identical request finds every full KV page of its prompt cached, but
still needs the logits of the prompt's last position, which only a forward over the tokens after
the last full page gives. This cache keeps that row of logits for recently prefilled prompts,
keyed by the whole prompt (`prefix_keys.prompt_key`: ids, positions, images and salt). A request
whose full pages are all cached and whose prompt key is found samples its first token from the
kept row in the step that admits it; the K/V of the tokens after its last full page are computed
in its next step, together with that first token, as a recomputed request's are.

Rows live on the device, least recently used out, within a fixed byte budget (a row is the
vocabulary in float32)."""

from __future__ import annotations

import torch

from mmpipe.engine.lru import ByteBoundedLRU

FIRST_TOKEN_CACHE_BYTES = 32 << 20


class FirstTokenCache(ByteBoundedLRU[torch.Tensor]):
    def __init__(self, capacity_bytes: int = FIRST_TOKEN_CACHE_BYTES) -> None:
        super().__init__(capacity_bytes, lambda row: row.numel() * row.element_size())

    def keep(self, key: bytes, logits: torch.Tensor) -> None:
        """Keep a copy of one row of logits ([1, vocab]) under `key`, unless the key is kept."""
        if key not in self:
            self.put(key, logits.clone())
