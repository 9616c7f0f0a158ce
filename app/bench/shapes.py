"""Model shapes the benchmarks build with random weights (never downloaded): the real published
configs' sizes per family. `--shape NAME` on `mmpipe bench vit|decode|prefill|caption`.

| name          | family     | LM                                 | vision tower                         |
|---------------|------------|------------------------------------|--------------------------------------|
| 3b            | Qwen2.5-VL | 36 x 2048, 16/2 heads, tied head   | 32 x 1280, windows, patch 14         |
| 7b            | Qwen2.5-VL | 28 x 3584, 28/4 heads              | 32 x 1280, windows, patch 14         |
| qwen3-vl-8b   | Qwen3-VL   | 36 x 4096, 32/8 heads, q/k norms   | 27 x 1152, patch 16, deepstack 8/16/24 |
| qwen2-vl-2b   | Qwen2-VL   | 28 x 1536, 12/2 heads, tied head   | 32 x 1280, no windows, patch 14      |
| qwen3-vl-30b-a3b | Qwen3-VL-MoE | 48 x 2048, 32/4 heads, 128 experts of 768, 8 per token | as qwen3-vl-8b's, to 2048 |
| qwen3-vl-235b-a22b | Qwen3-VL-MoE | 94 x 4096, 64/4 heads, 128 experts of 1536, 8 per token | as qwen3-vl-8b's, to 4096 |

Shapes too large to write to disk (`Shape.dummy`: the 30B-A3B's 61 GB, the 235B-A22B's 470 GB,
which no single GPU holds: `mmpipe bench moe` times one of its layers) get a checkpoint of
configs and tokenizer alone, loaded with `load_format="dummy"` (`load_options`): random weights
drawn on the GPU.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    family: str  # key of mmpipe.app.tiny.synthetic.FAMILY_CONFIGS
    label: str
    vision: dict[str, Any]
    text: dict[str, Any]
    tied: bool
    max_pixels: int
    dummy: bool = False  # no weights written; loaded with load_format="dummy"


QWEN25_VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2)
QWEN25_VL_3B_TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]})
QWEN25_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]})
QWEN3_VL_8B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                          deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
QWEN3_VL_8B_TEXT = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                        attention_bias=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True})
QWEN2_VL_2B_VISION = dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, hidden_size=1536, patch_size=14,
                          spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
QWEN2_VL_2B_TEXT = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [16, 24, 24]})

QWEN3_VL_30B_A3B_TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                             num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=262144,
                             attention_bias=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [24, 20, 20], "mrope_interleaved": True})
QWEN3_VL_235B_A22B_TEXT = dict(QWEN3_VL_30B_A3B_TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                               num_attention_heads=64, moe_intermediate_size=1536)

SHAPES = {
    "3b": Shape("qwen2_5_vl", "Qwen2.5-VL-3B", QWEN25_VL_3B_VISION, QWEN25_VL_3B_TEXT, True, 28 * 28 * 1280),
    "7b": Shape("qwen2_5_vl", "Qwen2.5-VL-7B", dict(QWEN25_VL_3B_VISION, out_hidden_size=3584), QWEN25_VL_7B_TEXT,
                False, 28 * 28 * 1280),
    "qwen3-vl-8b": Shape("qwen3_vl", "Qwen3-VL-8B", QWEN3_VL_8B_VISION, QWEN3_VL_8B_TEXT, False, 32 * 32 * 16384),
    "qwen2-vl-2b": Shape("qwen2_vl", "Qwen2-VL-2B", QWEN2_VL_2B_VISION, QWEN2_VL_2B_TEXT, True, 28 * 28 * 16384),
    "qwen3-vl-30b-a3b": Shape("qwen3_vl_moe", "Qwen3-VL-30B-A3B", dict(QWEN3_VL_8B_VISION, out_hidden_size=2048),
                              QWEN3_VL_30B_A3B_TEXT, False, 32 * 32 * 16384, dummy=True),
    "qwen3-vl-235b-a22b": Shape("qwen3_vl_moe", "Qwen3-VL-235B-A22B", dict(QWEN3_VL_8B_VISION, out_hidden_size=4096),
                                QWEN3_VL_235B_A22B_TEXT, False, 32 * 32 * 16384, dummy=True),
}


def add_shape_argument(parser: Any) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b",
                        help="model shape with random weights: "
                        + ", ".join(f"{k} ({v.label})" for k, v in SHAPES.items()))


def default_checkpoint_dir(shape: str, layers: int | None = None) -> str:
    name = "mmpipe-3b-random" if shape == "3b" else f"mmpipe-{shape}-random"
    return os.path.join(tempfile.gettempdir(), name + (f"-{layers}-layers" if layers else ""))


def hf_config(shape: str, layers: int | None = None) -> Any:
    """transformers' config of `shape`; `layers`: the language model cut to that many decoder
    layers (the widths unchanged), for a shape too large for the GPUs at hand."""
    from mmpipe.app.tiny.synthetic import FAMILY_CONFIGS, build_tokenizer

    spec = SHAPES[shape]
    text = spec.text if layers is None else dict(spec.text, num_hidden_layers=layers)
    return FAMILY_CONFIGS[spec.family](build_tokenizer(vocab_size=512), vision=spec.vision, text=text,
                                       tie_word_embeddings=spec.tied)


def add_layers_argument(parser: Any) -> None:
    parser.add_argument("--layers", type=int, default=None,
                        help="cut the language model to this many decoder layers, widths unchanged (a shape "
                             "too large for the GPUs at hand; per-token figures scale with the depth)")


def build_checkpoint(path: str | None, shape: str = "3b", device: str = "cuda", layers: int | None = None) -> str:
    """A checkpoint of `shape` with random bfloat16 weights in `path` (kept: a second run reuses
    it); `layers` cuts the language model's depth (`hf_config`)."""
    from mmpipe.app.tiny.synthetic import build_tokenizer, model_class, write_checkpoint

    path = path or default_checkpoint_dir(shape, layers)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    spec = SHAPES[shape]
    tokenizer = build_tokenizer(vocab_size=512)
    config = hf_config(shape, layers)
    if spec.dummy:
        return write_checkpoint(path, config, tokenizer, min_pixels=56 * 56, max_pixels=spec.max_pixels)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)._from_config(config, dtype=torch.bfloat16)
    write_checkpoint(path, model, tokenizer, min_pixels=56 * 56, max_pixels=spec.max_pixels)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def load_options(path: str) -> dict[str, Any]:
    """`Pipeline.from_pretrained`'s options for a bench checkpoint: `load_format="dummy"` where it
    has no weight files (`Shape.dummy`)."""
    return {} if any(f.endswith(".safetensors") for f in os.listdir(path)) else {"load_format": "dummy"}


def hf_model(path: str) -> Any:
    """transformers' model of the checkpoint's family, bfloat16 on the GPU (random weights drawn
    there for a checkpoint without weight files)."""
    from mmpipe.app.tiny.synthetic import model_class
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if load_options(path):
        with torch.device("cuda"):
            return model_class(config)._from_config(config, dtype=torch.bfloat16).eval()
    return model_class(config).from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


def label_of(path: str) -> str:
    """'Qwen3-VL' etc. for a checkpoint directory."""
    import json

    from mmpipe.models import spec_for

    with open(os.path.join(path, "config.json")) as handle:
        return spec_for(json.load(handle), path).family
