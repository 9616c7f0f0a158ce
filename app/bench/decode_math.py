"""`mmpipe bench decode`'s arithmetic, which needs no GPU: the bytes a decode step must read (the
bandwidth floor it is set against), ms per step by differencing two runs that differ only in their
new tokens, repeats and KV pages per run, and the decode-graph figures of `pipe.stats()` over a
timed region."""

from __future__ import annotations

import statistics
from typing import Any, Sequence


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a Qwen-VL config.json (nested or flat)."""
    text = dict(config.get("text_config") or config)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def head_dim_of(text: dict[str, Any]) -> int:
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def num_experts(text: dict[str, Any]) -> int:
    """0 for a dense model (transformers writes `num_local_experts`, Qwen's files `num_experts`)."""
    return int(text.get("num_experts") or text.get("num_local_experts") or 0)


def experts_read(text: dict[str, Any], batch: int) -> float:
    """Distinct experts a sparse layer reads for `batch` rows routed uniformly at random (each
    row picks `num_experts_per_tok` of `num_experts`): E * (1 - (1 - k / E) ** batch)."""
    experts, per_row = num_experts(text), text["num_experts_per_tok"]
    return experts * (1 - (1 - per_row / experts) ** batch)


def lm_weight_params(text: dict[str, Any], batch: int = 1) -> float:
    """Parameters a decode step of `batch` rows reads: every decoder layer (q/k/v with biases, o,
    gate/up/down, two norms), the final norm and the LM head. The input embedding is not counted:
    a step gathers B rows of it. A tied head is the embedding matrix and is counted once, as the
    head. A mixture-of-experts layer reads its router and the experts its rows chose
    (`experts_read`), which grows with the batch."""
    h, inter, layers = text["hidden_size"], text.get("intermediate_size", 0), text["num_hidden_layers"]
    heads, kv_heads, dim = text["num_attention_heads"], text["num_key_value_heads"], head_dim_of(text)
    q, kv = heads * dim, kv_heads * dim
    bias = bool(text.get("attention_bias", True))  # Qwen2: q/k/v biases; Qwen3: none (its configs say so)
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if bias else 0)
    sparse = 0
    if num_experts(text):
        step, dense = int(text.get("decoder_sparse_step") or 1), set(text.get("mlp_only_layers") or ())
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    moe = h * num_experts(text) + 3 * h * text.get("moe_intermediate_size", 0) * experts_read(text, batch) \
        if sparse else 0
    return layers * (attention + 2 * h) + (layers - sparse) * 3 * h * inter + sparse * moe + h + text["vocab_size"] * h


def fp8_weight_params(text: dict[str, Any], batch: int = 1) -> float:
    """The part of `lm_weight_params` that `quantization="fp8"` holds in FP8: every decoder layer's
    projections (q/k/v and o, the dense MLPs, the experts read), not their biases, the norms, the
    routers or the LM head."""
    h, inter, layers = text["hidden_size"], text.get("intermediate_size", 0), text["num_hidden_layers"]
    q, kv = text["num_attention_heads"] * head_dim_of(text), text["num_key_value_heads"] * head_dim_of(text)
    sparse = 0
    if num_experts(text):
        step, dense = int(text.get("decoder_sparse_step") or 1), set(text.get("mlp_only_layers") or ())
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    experts = 3 * h * text.get("moe_intermediate_size", 0) * experts_read(text, batch) if sparse else 0
    return layers * (2 * h * q + 2 * h * kv) + (layers - sparse) * 3 * h * inter + sparse * experts


def kv_bytes_per_step(text: dict[str, Any], batch: int, context: float, elem_bytes: int = 2) -> float:
    """K and V of every layer over `context` tokens for each of `batch` sequences."""
    return batch * context * text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim_of(text) \
        * elem_bytes


def mean_context(prompt_tokens: int, n1: int, n2: int) -> float:
    return prompt_tokens + (n1 + n2) / 2


def floor_ms(text: dict[str, Any], batch: int, context: float, copy_gbs: float, elem_bytes: int = 2,
             fp8: bool = False) -> float:
    """Bytes one decode step must read over the copy bandwidth (GB/s, read + write counted);
    `fp8`: the layers `quantization="fp8"` quantizes read one byte a weight."""
    weights = lm_weight_params(text, batch) * elem_bytes
    if fp8:
        weights -= fp8_weight_params(text, batch) * (elem_bytes - 1)
    total = weights + kv_bytes_per_step(text, batch, context, elem_bytes)
    return total / (copy_gbs * 1e9) * 1e3


def ms_per_step(t1_s: Sequence[float], t2_s: Sequence[float], n1: int, n2: int) -> float:
    """(median t(N2) - median t(N1)) / (N2 - N1), in ms, from wall times in seconds."""
    if n2 <= n1:
        raise ValueError(f"need N1 < N2, got {n1}, {n2}")
    return (statistics.median(t2_s) - statistics.median(t1_s)) * 1e3 / (n2 - n1)


def tokens_per_s(batch: int, ms: float | None) -> float | None:
    return batch * 1e3 / ms if ms and ms > 0 else None


def repeats_for(system: str, batch: int, repeats: int) -> int:
    """transformers with its dynamic cache is by far the slowest system (and its spread is small
    next to its step time): one repeat fewer, and a third of them at batch >= 128."""
    if system != "hf":
        return repeats
    return max(1, repeats // 3) if batch >= 128 else max(1, repeats - 1)


def kv_pages_needed(max_batch: int, prompt_tokens: int, n2: int, page_size: int) -> int:
    """Every request of the largest batch at full length, plus slack (and the reserved page)."""
    per_request = -(-(prompt_tokens + n2 + 1) // page_size)
    return max_batch * per_request + max(16, max_batch // 4) + 1


# ---------------------------------------------------------------------------- stats

def numeric_delta(before: Any, after: Any) -> Any:
    """after - before for every numeric leaf of nested dicts (keys only in `after` kept as is)."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {k: numeric_delta(before.get(k), v) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - before if isinstance(before, (int, float)) and not isinstance(before, bool) else after
    return after


def sum_known(values: Any) -> Any:
    """The sum of the numbers among `values`; None when there are none."""
    known = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(known) if known else None


def dig(stats: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(stats, dict):
            return None
        stats = stats.get(key)
    return stats


def graph_summary(after: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """Decode-graph figures from `pipe.stats()` (absolute after the run) and its delta over the
    timed region; None where the engine does not report a figure."""
    decode = dig(after, "decode") or {}
    graphs = decode.get("graphs")
    memory = decode.get("memory_bytes")
    steps, host = dig(delta, "runner", "decode_steps"), dig(delta, "runner", "decode_host_seconds")
    return {"capture_s": decode.get("capture_seconds"),
            "memory_MiB": memory / 2**20 if isinstance(memory, (int, float)) else None,
            "graphs": graphs,
            "replays": dig(delta, "decode", "replays"),
            "eager_steps": dig(delta, "decode", "eager_runs"),
            "host_us_per_step": host / steps * 1e6 if isinstance(host, (int, float)) and steps else None}
