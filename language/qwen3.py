"""The dense Qwen3 decoder of Qwen3-VL: the Qwen2 decoder of `language/qwen2.py` with Qwen3's
switches on (no QKV bias unless the config asks, q/k RMSNorm per head, interleaved M-RoPE) and
deepstack: the vision tower's features from `deepstack_visual_indexes` are added to the residual
stream after each of the first len(indexes) decoder layers, at the image-token rows.

The decoder's code is shared, not copied: every difference is a `TextConfig` field read here.
(Qwen3-VL's mixture-of-experts checkpoints swap the sparse layers' MLP: `language/qwen3_moe.py`.)
"""

from __future__ import annotations

from typing import Any

from mmpipe.language.qwen2 import Qwen2LanguageModel, TextConfig, text_fields

from mmpipe.errors import UnsupportedModelError


def qwen3_text_config(cfg: dict[str, Any]) -> TextConfig:
    tc = text_fields(cfg)
    if tc.get("num_experts") or tc.get("moe_intermediate_size"):
        raise UnsupportedModelError("config.json: Qwen3-VL mixture-of-experts checkpoints are not supported yet")
    levels = len((cfg.get("vision_config") or {}).get("deepstack_visual_indexes") or ())
    return TextConfig.from_hf(cfg, default_section=(24, 20, 20), qkv_bias=bool(tc.get("attention_bias", False)), qk_norm=True,
                              mrope_interleaved=True, deepstack_levels=levels)


class Qwen3LanguageModel(Qwen2LanguageModel):
    """Qwen3 decoder layers over flat tokens (see `Qwen2LanguageModel`; the config carries the
    differences)."""
