"""Model registry: a checkpoint's architecture name -> its vision tower, language model,
preprocessing and runners. The engine reaches per-family code only through a `ModelSpec`
(`LoadedModel.spec`): adding a model family (Qwen2-VL, Qwen3-VL) is one entry here plus its model
code; the pipeline and engine do not change.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmpipe.errors import CheckpointError, InputError, UnsupportedModelError
from mmpipe.language.attention import make_lm_attention
from mmpipe.language.decode_graphs import DecodeGraphRunner
from mmpipe.language.kv_cache import KVCache
from mmpipe.language.mrope import mrope_positions_of_runs
from mmpipe.language.prefill_graphs import PrefillRunner
from mmpipe.language.qwen2 import Qwen2LanguageModel, TextConfig
from mmpipe.language.qwen3 import Qwen3LanguageModel, qwen3_text_config
from mmpipe.language.qwen3_moe import Qwen3MoeLanguageModel, qwen3_moe_text_config
from mmpipe.language.tensor_parallel import shard_language_model, shard_slices
from mmpipe.layers.buffers import no_init
from mmpipe.layers.fp8 import Fp8Linear, fp8_available, quantize_linears
from mmpipe.layers.fp8_experts import Fp8Experts, quantize_experts
from mmpipe.quantization import (
    LM_FP8_LAYERS,
    VISION_FP8_LAYERS,
    Fp8Checkpoint,
    check_runtime_quantization,
    fp8_checkpoint,
)
from mmpipe.vision.attention import make_vision_attention
from mmpipe.vision.gpu_decode import deferred_jpeg
from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
from mmpipe.vision.metadata import build_pack_meta
from mmpipe.vision.preprocess import ImageProcessorConfig, patches_on_device, preprocess_image
from mmpipe.vision.qwen2_5_vl import Qwen25VisionTransformer, VisionConfig
from mmpipe.vision.qwen2_vl import FullAttentionVisionConfig, Qwen2VisionTransformer
from mmpipe.vision.qwen3_vl import Qwen3VisionTransformer, qwen3_vision_config
from mmpipe.vision.tensor_parallel import check_vision_shardable, shard_vision_tower
from mmpipe.vision.video_frames import build_video
from mmpipe.weights import (
    fill_random,
    load_checkpoint,
    materialize,
    place_fp8_experts,
    place_fp8_layers,
    prepare_for_kernels,
    read_json,
    stored_fp8_modules,
)

log = logging.getLogger("mmpipe")
DEFAULT_TOKENS_PER_SECOND = 4  # transformers' Qwen2.5-VL vision config default, where a checkpoint names none


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str  # the name users know (`mmpipe info`, the README's table)
    vision_config: Callable[[dict[str, Any]], Any]
    vision_model: Callable[..., nn.Module]  # (config, attention backend)
    text_config: Callable[[dict[str, Any]], Any]
    language_model: Callable[..., nn.Module]  # (config, attention backend)
    # What the engine runs per family (each a class or function of the family's own modules; no
    # defaults, so a new family names every one and never runs another family's code by omission):
    preprocess: Callable[..., Any]  # (PIL image, ImageProcessorConfig) -> ImageInput (host side)
    # (JPEG bytes, source, ImageProcessorConfig) -> an ImageInput the GPU decodes, or None (Pillow)
    defer_jpeg: Callable[..., Any]
    patches: Callable[..., Any]  # (ImageInputs of a pack, device) -> the ViT's input [patches, patch_dim] there
    positions: Callable[..., Any]  # (prompt length, VisualRuns, merge) -> (positions, delta)
    # (resized frames, ImageProcessorConfig, frame indices, video fps, sample fps) -> the video's groups
    preprocess_video: Callable[..., Any]
    # How a video's time reaches the model: "index" (the temporal position counts frame groups),
    # "seconds" (it counts tokens_per_second x seconds), "timestamps" (each group's time as text)
    video_time: str
    pack_meta: Callable[..., Any]  # (grids, merge, window, patch) -> the ViT pack's layout
    vit_runner: Callable[..., Any]  # a GraphRunner over the ViT
    vit_buckets: Callable[..., list[int]]  # (max patches, merge unit) -> graph sizes
    prefill_runner: Callable[..., Any]
    decode_runner: Callable[..., Any]
    kv_cache: Any
    shard_language: Callable[..., Any]  # (language model, TPGroup) -> the rank's shard, in place
    shard_slices: Callable[..., Any]  # (text config, TPGroup) -> (tensor name -> the rank's Slice, or None)
    shard_vision: Callable[..., Any]  # (loaded vision tower, TPGroup) -> the rank's shard, in place
    image_token: str = "<|image_pad|>"
    vision_start_token: str = "<|vision_start|>"


def _qwen_vl(architecture: str, family: str, vision_config: Callable[[dict[str, Any]], Any],
             vision_model: Callable[..., nn.Module], text_config: Callable[[dict[str, Any]], Any],
             language_model: Callable[..., nn.Module], video_time: str) -> ModelSpec:
    """A Qwen-VL family: its own towers and configs; the Qwen preprocessing, M-RoPE positions and
    pack layout (windows only where the tower has them), and the common runners and KV cache."""
    return ModelSpec(
        architecture=architecture, family=family, vision_config=vision_config, vision_model=vision_model,
        text_config=text_config, language_model=language_model, preprocess=preprocess_image,
        defer_jpeg=deferred_jpeg, patches=patches_on_device,
        positions=mrope_positions_of_runs, preprocess_video=build_video, video_time=video_time,
        pack_meta=build_pack_meta, vit_runner=ViTGraphRunner,
        vit_buckets=default_buckets, prefill_runner=PrefillRunner, decode_runner=DecodeGraphRunner, kv_cache=KVCache,
        shard_language=shard_language_model, shard_slices=shard_slices, shard_vision=shard_vision_tower)


REGISTRY: dict[str, ModelSpec] = {spec.architecture: spec for spec in (
    _qwen_vl("Qwen2_5_VLForConditionalGeneration", "Qwen2.5-VL", VisionConfig.from_hf, Qwen25VisionTransformer,
             TextConfig.from_hf, Qwen2LanguageModel, "seconds"),
    _qwen_vl("Qwen2VLForConditionalGeneration", "Qwen2-VL", FullAttentionVisionConfig.qwen2_vl,
             Qwen2VisionTransformer, TextConfig.from_hf, Qwen2LanguageModel, "index"),
    _qwen_vl("Qwen3VLForConditionalGeneration", "Qwen3-VL", qwen3_vision_config, Qwen3VisionTransformer,
             qwen3_text_config, Qwen3LanguageModel, "timestamps"),
    _qwen_vl("Qwen3VLMoeForConditionalGeneration", "Qwen3-VL-MoE", qwen3_vision_config, Qwen3VisionTransformer,
             qwen3_moe_text_config, Qwen3MoeLanguageModel, "timestamps"),
)}


def spec_for(hf_config: dict[str, Any], where: str) -> ModelSpec:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in REGISTRY:
            return REGISTRY[arch]
    raise UnsupportedModelError(
        f"{where}: architecture {archs or hf_config.get('model_type')!r} is not supported; "
        f"supported: {', '.join(f'{spec.family} ({arch})' for arch, spec in REGISTRY.items())}")


def check_tensor_parallel_split(path: str, size: int, vision: bool = False, expert_parallel: bool = False) -> None:
    """An `UnsupportedModelError` naming what `size` ranks cannot split in the checkpoint's language
    model (head counts, MLP width, experts) and, with `vision` (`vit_parallel="tensor"`), the vision
    tower's heads, read from its config.json before any process starts or any weight loads."""
    from mmpipe.layers.parallel import TPGroup

    hf_config = read_json(path, "config.json")
    spec = spec_for(hf_config, path)
    spec.shard_slices(spec.text_config(hf_config), TPGroup(0, size, expert_parallel=expert_parallel))
    if vision:
        check_vision_shardable(spec.vision_config(hf_config), size)


@dataclass
class LoadedModel:
    """A checkpoint's models on their device, plus the facts the engine needs about them."""

    path: str
    spec: ModelSpec
    hf_config: dict[str, Any]
    vision: nn.Module
    language: nn.Module
    image_processor: ImageProcessorConfig
    image_token_id: int
    video_token_id: int | None  # None: the checkpoint takes no video
    tokens_per_second: float  # Qwen2.5-VL's temporal positions per second of video
    device: torch.device
    dtype: torch.dtype
    quantization: str | None = None  # how the checkpoint's weights were stored, and what was done with them
    tp: Any = None  # the language model's tensor-parallel group (`TPGroup`) once sharded, else None

    @property
    def merge_size(self) -> int:
        return self.vision.cfg.spatial_merge_size


def _describe_stored(fp8: Fp8Checkpoint | None, dtype: torch.dtype, kept: int, refused: int, experts: int = 0
                     ) -> str | None:
    """How an FP8 checkpoint's weights are held in this run (`mmpipe info`, the load log line)."""
    if fp8 is None:
        return None
    to = str(dtype).removeprefix("torch.")
    if not kept and not experts:
        why = "no FP8 tensor cores on this device" if not refused else "shapes the FP8 kernels do not take"
        return f"{fp8.describe()}, dequantized to {to} at load ({why})"
    rest = f"; {refused} more dequantized to {to} (shapes the FP8 kernels do not take)" if refused else ""
    moe = f" and {experts} layers of experts" if experts else ""
    return (f"{fp8.describe()}; {kept} language-model linear layers{moe} kept in FP8{rest}; other FP8 weights "
            "dequantized")


def load_model(path: str, device: torch.device, dtype: torch.dtype, attention_backend: str = "auto",
               extend_attention: str = "auto", quantization: str | None = None,
               keep_fp8: bool | None = None, tp: Any = None, shard_vision: bool = False,
               load_format: str = "auto") -> LoadedModel:
    """Build the checkpoint's models on `device` with the attention backends chosen for it.
    An FP8 checkpoint's language-model projections stay in FP8 (`Fp8Linear`) where `keep_fp8`
    (default: the device has FP8 tensor cores), everything else of it is dequantized;
    `quantization="fp8"`: the language model's linear layers quantized to FP8 after loading.
    `tp` (a `TPGroup`, its backend attached later): the language model is built as that rank's
    shard and only its part of each tensor is read from the files (an FP8 checkpoint's kept
    layers with their scales split alongside; `quantization` then quantizes the shard's layers).
    `shard_vision` (with `tp`): the vision tower too, loaded whole, then cut to the rank's shard.
    `load_format="dummy"`: random weights instead of the files (`fill_random`), for benchmarks."""
    quantization = check_runtime_quantization(quantization, device)  # before anything loads
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r}: not a directory (models load from a local checkpoint directory)")
    hf_config = read_json(path, "config.json")
    spec = spec_for(hf_config, path)
    fp8 = fp8_checkpoint(hf_config, path)  # an unsupported quantization is refused before anything loads
    vision_cfg = spec.vision_config(hf_config)
    text_cfg = spec.text_config(hf_config)
    vision_attention = make_vision_attention(attention_backend, device, dtype)
    try:
        language_attention = make_lm_attention(attention_backend, device, dtype, text_cfg.head_dim**-0.5,
                                               extend_attention)
    except ValueError as exc:
        raise InputError(f"EngineConfig.attention_backend: {exc}") from None
    with torch.device("meta"), no_init():  # every weight is loaded below
        vision = spec.vision_model(vision_cfg, vision_attention)
        language = spec.language_model(text_cfg, language_attention)
    slices = None
    if tp is not None:
        slices = {"language": spec.shard_slices(text_cfg, tp)}  # checks the split before anything is read
        language = spec.shard_language(language, tp)  # the shard's structure, on the meta device
    kept: set[str] = set()
    placed = {"refused": 0}

    def keep_fp8_layers(meta_language: nn.Module) -> None:
        stored_fp8 = stored_fp8_modules(path)
        found, placed["refused"] = place_fp8_layers("language", meta_language, LM_FP8_LAYERS, stored_fp8, fp8)
        experts, refused_experts = place_fp8_experts("language", meta_language, stored_fp8, fp8)
        kept.update(found | experts)
        placed["refused"] += refused_experts

    keep = fp8 is not None and (fp8_available(device) if keep_fp8 is None else keep_fp8)
    vision = materialize(vision, device, dtype)
    language = materialize(language, device, dtype, keep_fp8_layers if keep else None)
    if load_format == "dummy":
        if fp8 is not None:
            raise InputError(f"{path}: load_format='dummy' draws {dtype} weights; this is an FP8 checkpoint")
        fill_random({"vision": vision, "language": language})
    else:
        load_checkpoint(path, {"vision": vision, "language": language}, device, dtype, fp8, frozenset(kept), slices)
    if tp is not None and shard_vision:
        spec.shard_vision(vision, tp)  # before the width padding: each rank pads its own part
    prepare_for_kernels(vision)
    prepare_for_kernels(language)
    stored = _describe_stored(fp8, dtype, sum(isinstance(m, Fp8Linear) for m in language.modules()),
                              placed["refused"], sum(isinstance(m, Fp8Experts) for m in language.modules()))
    if stored is not None:
        log.info("%s: %s", path, stored)
    if quantization in ("fp8", "fp8-all"):
        layers = quantize_linears(language, LM_FP8_LAYERS)
        done = f"{layers} language-model linear layers"
        experts, left = quantize_experts(language)
        if experts or left:
            done += f", {experts} layers of experts (128x128 block scales)"
            done += f" ({left} left in {str(dtype).removeprefix('torch.')}: widths not whole blocks)" if left else ""
        if quantization == "fp8-all":
            done += f" and {quantize_linears(vision, VISION_FP8_LAYERS)} vision-tower ones"
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the bfloat16 weights' blocks, for the KV cache to size itself on
        stored = (f"{stored + '; then ' if stored else ''}{quantization}: {done} quantized at load (E4M3, "
                  "per-channel weight scales, per-token activation scales)")
        log.info("%s: %s", path, stored)
    if vision_cfg.out_hidden_size != text_cfg.hidden_size:
        raise CheckpointError(f"{path}: vision out_hidden_size {vision_cfg.out_hidden_size} != language "
                              f"hidden_size {text_cfg.hidden_size}")
    image_token_id = hf_config.get("image_token_id")
    if image_token_id is None:
        raise CheckpointError(f"{path}: config.json has no image_token_id")
    video_token_id = hf_config.get("video_token_id")
    tokens_per_second = (hf_config.get("vision_config") or {}).get("tokens_per_second", DEFAULT_TOKENS_PER_SECOND)
    return LoadedModel(path=path, spec=spec, hf_config=hf_config, vision=vision, language=language,
                       image_processor=ImageProcessorConfig.from_dir(path), image_token_id=int(image_token_id),
                       video_token_id=None if video_token_id is None else int(video_token_id),
                       tokens_per_second=float(tokens_per_second), device=device, dtype=dtype, quantization=stored,
                       tp=tp)
