"""Synthetic checkpoints for tests, benchmarks and training, made with transformers' own classes.

- `build_tokenizer`: a byte-level BPE tokenizer trained with `tokenizers` on a small corpus,
  carrying the Qwen special tokens and a Qwen2-VL style chat template.
- `qwen2_5_vl_config`, `qwen2_vl_config`, `qwen3_vl_config`, `qwen3_vl_moe_config` (`FAMILY_CONFIGS`): a config of each
  supported family, of any size (tiny for tests, real shapes for benchmarks).
- `write_checkpoint`: random (or given) weights saved with `save_pretrained`, plus tokenizer,
  preprocessor and generation configs: a directory `Pipeline.from_pretrained` and
  transformers both load.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

CHAT_TEMPLATE = r"""
{%- for message in messages -%}
  {%- if loop.first and message['role'] != 'system' -%}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
  {%- endif -%}
  {{- '<|im_start|>' + message['role'] + '\n' -}}
  {%- if message['content'] is string -%}
    {{- message['content'] -}}
  {%- else -%}
    {%- for part in message['content'] -%}
      {%- if part['type'] == 'image' -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif part['type'] == 'video' -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
      {%- elif part['type'] == 'text' -%}
        {{- part['text'] -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

BASE_CORPUS = [
    "You are a helpful assistant.", "Describe this image.", "What is in the picture?",
    "system user assistant", "The quick brown fox jumps over the lazy dog.",
    "a large red circle on the left and a small blue star at the top right",
    "Hello, how are you today? I am fine, thank you.", "0123456789 .,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`",
]


def build_tokenizer(corpus: Iterable[str] = (), vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer (any text encodes) with the Qwen special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=QWEN_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(BASE_CORPUS) + list(corpus), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=QWEN_SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def qwen2_5_vl_config(tokenizer: Any, *, vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None,
                      tie_word_embeddings: bool = False) -> Any:
    """A Qwen2.5-VL config whose token ids match `tokenizer`. Defaults are tiny."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    vision_cfg = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                      fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
    vision_cfg.update(vision or {})
    text_cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                    bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                    pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=tie_word_embeddings)
    text_cfg.update(text or {})
    if vision_cfg["out_hidden_size"] != text_cfg["hidden_size"]:
        vision_cfg["out_hidden_size"] = text_cfg["hidden_size"]
    return Qwen2_5_VLConfig(vision_config=vision_cfg, text_config=text_cfg, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie_word_embeddings)


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _text_defaults(tokenizer: Any, tie_word_embeddings: bool) -> dict[str, Any]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=tie_word_embeddings)


def qwen2_vl_config(tokenizer: Any, *, vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None,
                    tie_word_embeddings: bool = False) -> Any:
    """A Qwen2-VL config (LayerNorm/QuickGELU tower without windows, Qwen2 decoder). Tiny by default.
    Its vision `hidden_size` is the merger's output width (the tower's own is `embed_dim`)."""
    from transformers import Qwen2VLConfig

    text_cfg = _text_defaults(tokenizer, tie_word_embeddings)
    text_cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text_cfg.update(text or {})
    vision_cfg = dict(depth=2, embed_dim=64, mlp_ratio=2, num_heads=4, hidden_size=text_cfg["hidden_size"],
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    vision_cfg.update(vision or {})
    return Qwen2VLConfig(vision_config=vision_cfg, text_config=text_cfg, tie_word_embeddings=tie_word_embeddings,
                         **_token_ids(tokenizer))


def qwen3_vl_config(tokenizer: Any, *, vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None,
                    tie_word_embeddings: bool = False) -> Any:
    """A Qwen3-VL config (patch 16, learned positions, deepstack; Qwen3 decoder with q/k norms and
    interleaved M-RoPE). Tiny by default, with a head dim (24) unlike hidden / heads (16), as the
    real 4B shape has, and deepstack into the first two of three layers."""
    from transformers import Qwen3VLConfig

    text_cfg = _text_defaults(tokenizer, tie_word_embeddings)
    text_cfg.update(num_hidden_layers=3, head_dim=24,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4],
                                     "mrope_interleaved": True})
    text_cfg.update(text or {})
    vision_cfg = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=text_cfg["hidden_size"],
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1])
    vision_cfg.update(vision or {})
    vision_cfg["out_hidden_size"] = text_cfg["hidden_size"]
    return Qwen3VLConfig(vision_config=vision_cfg, text_config=text_cfg, tie_word_embeddings=tie_word_embeddings,
                         **_token_ids(tokenizer))


def qwen3_vl_moe_config(tokenizer: Any, *, vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None,
                        tie_word_embeddings: bool = False) -> Any:
    """A Qwen3-VL-MoE config: Qwen3-VL's (tiny by default) with 8 experts of width 48, 2 per
    token, in every layer but the second (`mlp_only_layers`, a dense MLP there)."""
    from transformers import Qwen3VLMoeConfig

    text = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "decoder_sparse_step": 1,
            "mlp_only_layers": [1], **(text or {})}
    dense = qwen3_vl_config(tokenizer, vision=vision, text=text, tie_word_embeddings=tie_word_embeddings)
    return Qwen3VLMoeConfig(vision_config=dense.vision_config.to_dict(), text_config=dense.text_config.to_dict(),
                            tie_word_embeddings=tie_word_embeddings, **_token_ids(tokenizer))


def random_model(config: Any, seed: int = 0, logit_scale: float = 1.0) -> Any:
    """transformers' model for `config`'s family with random weights. `logit_scale` > 1 sharpens
    the output distribution so greedy decoding has clear winners (random heads give near-ties)."""
    torch.manual_seed(seed)
    model = model_class(config)(config).eval()
    with torch.no_grad():  # routers with a spread: tokens go to many experts, never to near-ties
        for name, weight in model.named_parameters():
            if name.endswith(".mlp.gate.weight") and weight.dim() == 2 and weight.shape[0] > 1:
                weight.normal_(0.0, 2.0 / weight.shape[1] ** 0.5)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


def model_class(config: Any) -> Any:
    """transformers' class of a config's family."""
    import transformers

    name = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
            "qwen3_vl": "Qwen3VLForConditionalGeneration",
            "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}[config.model_type]
    return getattr(transformers, name)


FAMILY_CONFIGS = {"qwen2_5_vl": qwen2_5_vl_config, "qwen2_vl": qwen2_vl_config, "qwen3_vl": qwen3_vl_config,
                  "qwen3_vl_moe": qwen3_vl_moe_config}


def write_checkpoint(path: str, model: Any, tokenizer: Any, *, min_pixels: int | None = None,
                     max_pixels: int | None = None, layout: str | None = None,
                     generation: dict[str, Any] | None = None, max_shard_size: str | None = None) -> str:
    """Save model, tokenizer, preprocessor and generation config into `path`. The preprocessor
    is the family's (Qwen3-VL: patch 16, mean and std 0.5); pixel limits default to 4 to 256
    merged patches. `model` may be a config alone: no weights are written (a shape too large to
    write, loaded with `load_format="dummy"`).

    layout "published": `visual.*` / `model.*` (the published Qwen2-VL and Qwen2.5-VL files, and
    what transformers 5 writes for them); "transformers": `model.visual.*` /
    `model.language_model.*` (transformers 5 in memory; the published Qwen3-VL files, and what it
    writes for Qwen3-VL); None: as transformers writes the family.
    """
    from transformers import PretrainedConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    os.makedirs(path, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    config = model if isinstance(model, PretrainedConfig) else model.config
    if config is model:
        config.architectures = [model_class(config).__name__]  # what save_pretrained records for a model
    model.save_pretrained(path, **({} if config is model else kwargs))
    tokenizer.save_pretrained(path)
    qwen3 = config.model_type in ("qwen3_vl", "qwen3_vl_moe")
    patch = 16 if qwen3 else 14
    factor = patch * 2
    normalise = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if qwen3 else {}
    Qwen2VLImageProcessorPil(min_pixels=min_pixels or factor * factor * 4, max_pixels=max_pixels or factor * factor * 256,
                             patch_size=patch, **normalise).save_pretrained(path)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    gen = {"eos_token_id": eos, "pad_token_id": eos[1], "do_sample": False}
    gen.update(generation or {})
    with open(os.path.join(path, "generation_config.json"), "w") as handle:
        json.dump(gen, handle, indent=2)
    if layout not in (None, "published", "transformers"):
        raise ValueError(f"layout {layout!r}: use 'published' or 'transformers'")
    if layout is not None and config is not model and layout != saved_layout(path):  # transformers writes Qwen2(.5)-VL one way and Qwen3-VL the other
        if layout == "transformers":
            rename_layout(path, {"visual.": "model.visual.", "model.": "model.language_model."})
        else:
            rename_layout(path, {"model.visual.": "visual.", "model.language_model.": "model."})
    return path


def saved_layout(path: str) -> str:
    """'transformers' if the checkpoint's tensors are named `model.visual.*`, else 'published'."""
    from safetensors import safe_open

    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), "pt") as handle:
            if any(name.startswith("model.visual.") for name in handle.keys()):
                return "transformers"
    return "published"


def rename_layout(path: str, prefixes: dict[str, str]) -> None:
    """Rewrite tensor-name prefixes in every safetensors file (and the shard index) of `path`."""
    from safetensors.torch import load_file, save_file

    def rename(name: str) -> str:
        for old, new in prefixes.items():
            if name.startswith(old):
                return new + name[len(old):]
        return name

    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        full = os.path.join(path, file)
        tensors = load_file(full)
        save_file({rename(k): v for k, v in tensors.items()}, full, metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as handle:
            data = json.load(handle)
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        with open(index, "w") as handle:
            json.dump(data, handle, indent=2)
