"""Qwen2 decoder (the language model of Qwen2-VL and Qwen2.5-VL) with M-RoPE, over flat tokens;
with its config's switches also the dense Qwen3 decoder of Qwen3-VL (`language/qwen3.py`): no QKV
bias, q/k RMSNorm per head (fused into the rotary + KV write), interleaved M-RoPE (a different
frequency-to-axis map of the same tables), and deepstack (extra features added to the residual
stream after each of the first layers, at the rows the caller fills; zeros elsewhere).

Tokens of all sequences in a step are concatenated: hidden states are [T, hidden], positions
[3, T]. Attention's per-step metadata comes from the forward context, so `forward` has only
tensor inputs and no data-dependent control flow: it can be traced, split and captured.
The rotary tables are computed once per step; each layer rotates q and k and writes K/V into the
cache (passed in, with the rows' slots) in one fused op. Products of a few rows (decode) run on
the kernels of `mmpipe.kernels.gemv`; the o and down projections may return K-split partial sums,
which the fused residual add + norm after them adds up. Attention is the backend given at
construction, called directly in eager code and through the `mmpipe::lm_attention` custom op under
`torch.compile` (the op is opaque to the compiler: the piecewise prefill runner splits the model
there; the rotary + KV write, `mmpipe::rope_kv_write`, stays inside the captured pieces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from mmpipe.language.attention import AttentionMetadata, TorchLMAttention
from mmpipe.language.attention.op import rope_attention  # also registers the mmpipe:: custom ops
from torch import nn

from mmpipe.errors import CheckpointError, UnsupportedModelError
from mmpipe.kernels import gemv, gemv_fp8
from mmpipe.kernels.fused import add_rms_norm
from mmpipe.kernels.partial_sums import PartialSums
from mmpipe.layers.attention import AttentionBackend
from mmpipe.layers.buffers import on_ambient_device
from mmpipe.layers.context import get_forward_context
from mmpipe.layers.fp8 import Fp8Linear, Fp8Rows, fp8_input
from mmpipe.layers.mlp import GatedMLP
from mmpipe.layers.norm import RMSNorm
from mmpipe.layers.parallel import TPGroup, reduce_rows
from mmpipe.layers.weight_map import WeightMap


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    head_dim: int = 0  # 0: hidden_size // num_heads (Qwen3 configs name it, and it may differ)
    qkv_bias: bool = True
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before the rotation
    mrope_interleaved: bool = False  # Qwen3: frequency i takes axis i % 3 (within the sections)
    deepstack_levels: int = 0  # Qwen3-VL: features added after each of the first N layers
    # Mixture of experts (Qwen3-VL-MoE, `language/qwen3_moe.py`): 0 experts for a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], default_section: tuple[int, ...] = (16, 24, 24), **family: Any
                ) -> "TextConfig":
        """Read the nested `text_config` (transformers 5) or the flat layout of published checkpoints.
        `family`: the fields a family fixes rather than reads (e.g. Qwen3's q/k norms)."""
        tc = text_fields(cfg)
        rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
        theta = rope.get("rope_theta", tc.get("rope_theta", 1_000_000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise UnsupportedModelError(f"config.json: rope type {rope_type!r} is not supported")
        if tc.get("use_sliding_window"):
            raise UnsupportedModelError("config.json: use_sliding_window=true is not supported")
        tie = bool(cfg.get("tie_word_embeddings", False) or tc.get("tie_word_embeddings", False))
        try:
            out = cls(
                vocab_size=int(tc["vocab_size"]),
                hidden_size=int(tc["hidden_size"]),
                intermediate_size=int(tc["intermediate_size"]),
                num_layers=int(tc["num_hidden_layers"]),
                num_heads=int(tc["num_attention_heads"]),
                num_kv_heads=int(tc.get("num_key_value_heads") or tc["num_attention_heads"]),
                rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                mrope_section=tuple(int(s) for s in rope.get("mrope_section", default_section)),
                hidden_act=str(tc.get("hidden_act", "silu")),
                tie_word_embeddings=tie,
                max_position_embeddings=int(tc.get("max_position_embeddings", 32768)),
                head_dim=int(tc.get("head_dim") or 0),
                **family,
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json: the language model config lacks {exc.args[0]!r}") from None
        if (not tc.get("head_dim") and out.hidden_size % out.num_heads) or out.num_heads % out.num_kv_heads:
            raise CheckpointError("config.json: hidden_size, num_attention_heads and num_key_value_heads "
                                  "are inconsistent")
        if sum(out.mrope_section) * 2 != out.head_dim:
            raise CheckpointError(f"config.json: mrope_section {list(out.mrope_section)} does not cover half "
                                  f"the head dim ({out.head_dim // 2})")
        return out


def text_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config fields: nested `text_config` (transformers 5), else the flat
    layout of published checkpoints (text fields at the top level)."""
    tc = dict(cfg.get("text_config") or {})
    for key, value in cfg.items():
        if key not in ("text_config", "vision_config"):
            tc.setdefault(key, value)
    return tc


class MRotary(nn.Module):
    """Rotary tables for M-RoPE: frequency i uses the t, h or w position. Chunked (Qwen2-VL,
    Qwen2.5-VL): the first `mrope_section[0]` frequencies take t, the next h, the rest w.
    Interleaved (Qwen3-VL): frequency i takes h if i % 3 == 1 and i < 3 * section[1], w if
    i % 3 == 2 and i < 3 * section[2], else t. Only this map differs; the tables' layout is the
    same, so the rotary kernels serve both."""

    def __init__(self, head_dim: int, theta: float, section: tuple[int, ...], interleaved: bool = False) -> None:
        super().__init__()
        self.head_dim, self.theta, self.section, self.interleaved = head_dim, theta, section, interleaved
        self.register_buffer("inv_freq", on_ambient_device(self._inv_freq()), persistent=False)
        self.register_buffer("axis", on_ambient_device(self._axis()), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float, device="cpu")
        return 1.0 / (self.theta ** (steps / self.head_dim))

    def _axis(self) -> torch.Tensor:
        if not self.interleaved:
            return torch.cat([torch.full((n,), i % 3, dtype=torch.long, device="cpu")
                              for i, n in enumerate(self.section)])
        axis = torch.zeros(self.head_dim // 2, dtype=torch.long, device="cpu")
        for dim in (1, 2):
            axis[dim: 3 * self.section[dim]: 3] = dim
        return axis

    def init_buffers(self) -> None:
        device = self.inv_freq.device
        self.inv_freq, self.axis = self._inv_freq().to(device), self._axis().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] -> cos, sin [T, head_dim] in `dtype`."""
        pos = positions.index_select(0, self.axis).t().float()  # [T, head_dim/2]
        freqs = pos * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, attention: AttentionBackend[AttentionMetadata]) -> None:
        super().__init__()
        self.layer = layer
        self.attention = attention
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.tp: TPGroup | None = None  # a tensor-parallel shard's group: o_proj's product is summed over it

    def forward(self, x: torch.Tensor | Fp8Rows, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor
                ) -> torch.Tensor | PartialSums:
        n = x.shape[0]
        qkv = _project(self.qkv_proj, x)
        k_cache, v_cache = kv_cache
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
        q_norm = self.q_norm.weight if self.q_norm is not None else None
        k_norm = self.k_norm.weight if self.k_norm is not None else None
        if torch.compiler.is_compiling():  # rotary + KV write stay in the pieces; attention is the split point
            heads = self.num_heads + self.num_kv_heads
            v = qkv.view(n, heads + self.num_kv_heads, self.head_dim)[:, heads:]
            q, k = torch.ops.mmpipe.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slot_mapping, self.num_heads,
                                                  self.num_kv_heads, self.head_dim, q_norm, k_norm, self.eps)
            torch.ops.mmpipe.lm_attention(q, k, v, out, self.layer)
        else:  # a custom op's dispatch costs more host time than the kernels take; decode: one kernel
            rope_attention(qkv, cos, sin, kv_cache, slot_mapping, out, self.layer, self.attention, self.num_heads,
                           self.num_kv_heads, self.head_dim, q_norm, k_norm, self.eps)
        return reduce_rows(self.tp, _project(self.o_proj, out.view(n, self.q_size), split=True))


def _project(layer: nn.Module, x: torch.Tensor | Fp8Rows, split: bool = False) -> torch.Tensor | PartialSums:
    """A projection through `gemv` (few-row kernels for decode, K-split partial sums where `split`);
    an FP8 layer (`quantization="fp8"`) through gemv's FP8 kernels for decode rows, else itself
    (its FP8 product, K-split too where `split`; `Fp8Rows`, input the norm before it quantized, go
    there too). A split one-row FP8 product may come pending (`PartialSums`): the decoder
    layer hands it to `add_rms_norm` next, which launches it with the add and norm inside."""
    if isinstance(layer, Fp8Linear):
        if isinstance(x, Fp8Rows) or not gemv_fp8.fp8_usable(x, layer.weight):
            return layer(x, split=split)
        if split and layer.bias is None:
            return gemv_fp8.fp8_linear_split(x, layer.weight, layer.weight_scale, defer=True)
        return gemv_fp8.fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)
    return (gemv.linear_split if split else gemv.linear)(x, layer.weight, layer.bias)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, attention: AttentionBackend[AttentionMetadata]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen2Attention(cfg, layer, attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False, few_row_kernels=True)

    def forward(self, residual: torch.Tensor, normed: torch.Tensor | Fp8Rows, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                next_norm: RMSNorm, extra: torch.Tensor | None = None, next_proj: nn.Module | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """x + attn(input_norm(x)), then + mlp(post_norm(.)); takes input_norm(x) precomputed and
        returns the new residual with `next_norm` of it, so every residual add is fused with the
        norm after it (one kernel, transformers' rounding: the sum rounded, then normed). `extra`
        (deepstack features, zero on rows without any) is added after the MLP's sum, rounded as
        transformers adds it. `next_proj`: the layer that reads `next_norm`'s output; where it
        quantizes its input (FP8, `fp8_input`), the norm comes quantized that way (`Fp8Rows`)."""
        post = self.post_attention_layernorm
        mlp_in = getattr(self.mlp, "gate_up_proj", None)  # (none in a mixture of experts: no FP8 rows)
        residual, normed = add_rms_norm(residual, self.self_attn(normed, cos, sin, kv_cache, slot_mapping),
                                        post.weight, post.eps, fp8_input(mlp_in, residual))
        mlp_out = self.mlp(normed)
        if extra is not None:  # prefill only; a short one's rows may come as K-split partial sums
            residual = residual + (mlp_out.total() if isinstance(mlp_out, PartialSums) else mlp_out)
            mlp_out = extra
        fp8 = fp8_input(next_proj, residual)  # (None: no reader of the norm to quantize for)
        return add_rms_norm(residual, mlp_out, next_norm.weight, next_norm.eps, fp8)


def _is_decode_step() -> bool:
    try:
        return bool(getattr(get_forward_context().attn_metadata, "is_decode", False))
    except RuntimeError:  # no forward context: not an engine step
        return False


class Qwen2LanguageModel(nn.Module):
    def __init__(self, cfg: TextConfig, attention: AttentionBackend[AttentionMetadata] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.attention = attention if attention is not None else TorchLMAttention(cfg.head_dim**-0.5)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = MRotary(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, i, self.attention) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # Sizes the engine needs to lay out the KV cache.
    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.cfg.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.head_dim

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def deepstack_levels(self) -> int:
        """Feature levels the prefill adds after the first layers (one input buffer each)."""
        return self.cfg.deepstack_levels

    def embed(self, token_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [T, hidden], written into `out` (e.g. rows of a fixed buffer) when given."""
        if out is None:
            return self.embed_tokens(token_ids)
        return torch.index_select(self.embed_tokens.weight, 0, token_ids, out=out)

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
                deepstack: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """input_embeds [T, hidden], positions [3, T] -> final-normed hidden states [T, hidden].
        `deepstack`: [T, hidden] features added after layer i (i < len), zero on rows that have
        none; a prefill of a deepstack model always passes all levels (decode passes none).
        `kv_caches`: each layer's paged (K, V) [pages, page_size, kv_heads, head_dim]; row t's new
        K/V go to flat slot `slot_mapping[t]` (padded rows: the dummy page). Per-layer tensors (not
        one cache indexed by layer) keep the layers' traced pieces identical, so a compiler
        compiles one for all. The few-row kernels (`gemv`) serve decode steps only, so an eager
        prefill matches the compiled one bit for bit."""
        if torch.compiler.is_compiling():
            return self._forward(input_embeds, positions, kv_caches, slot_mapping, deepstack)
        with gemv.allowed(_is_decode_step()):
            return self._forward(input_embeds, positions, kv_caches, slot_mapping, deepstack)

    def _forward(self, input_embeds: torch.Tensor, positions: torch.Tensor,
                 kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
                 deepstack: Sequence[torch.Tensor]) -> torch.Tensor:
        cos, sin = self.rotary(positions, input_embeds.dtype)
        first = self.layers[0].input_layernorm
        residual, normed = add_rms_norm(input_embeds, None, first.weight, first.eps,
                                        fp8_input(self.layers[0].self_attn.qkv_proj, input_embeds))
        for index, layer in enumerate(self.layers):
            last = index + 1 == len(self.layers)
            following = self.norm if last else self.layers[index + 1].input_layernorm
            extra = deepstack[index] if index < len(deepstack) else None
            residual, normed = layer(residual, normed, cos, sin, kv_caches[index], slot_mapping, following, extra,
                                     None if last else self.layers[index + 1].self_attn.qkv_proj)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return gemv.linear(hidden, weight, out_dtype=torch.float32)  # rounded to the model dtype first

    def weight_map(self) -> WeightMap:
        """Checkpoint names (relative to the language model, plus `lm_head.weight`) -> parameters."""
        inter = self.cfg.intermediate_size
        q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        return WeightMap(
            self,
            fused={".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
                   ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
                   ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
                   ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
                   ".mlp.up_proj.": (".mlp.gate_up_proj.", 1)},
            blocks={".self_attn.qkv_proj.": [q, kv, kv], ".mlp.gate_up_proj.": [inter, inter]},
        )

    def optional_weight_names(self) -> set[str]:
        """Names a checkpoint may carry that this model ignores (a tied head saved anyway)."""
        return {"lm_head.weight"} if self.lm_head is None else set()
