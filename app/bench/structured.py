"""`mmpipe bench structured`: what structured output costs a decode step.

One process, one Pipeline (graphs on), 3B shape with random weights. Rows: batch 1, 32 and 128
(`--batches`), each once with every row free and once with half the rows constrained by a JSON
Schema (at batch 1, its one row). The schema (objects of short strings and numbers in an array
that must hold more items than a run can write) keeps every constrained row going as long as the
free ones, so every step has the same rows.

The grammar's cost depends on the tokenizer: a mask walks the vocabulary's tokens. The synthetic
tokenizer of the other benchmarks has a few hundred; this one has the Qwen vocabulary's size (its
special tokens at the same ids, then the 256 bytes, then pieces made by merging random printable
pieces, as byte-level BPE builds them), written beside the checkpoint's weights.

Columns: decode ms/step (the time of `--long` output tokens minus that of `--short`, over the
difference: the prefill and start cancel), the same with half the batch constrained, their
difference, and the host seconds per step spent filling masks (on llguidance's threads, while the
GPU runs the step's forward).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np
from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import SHAPES, add_shape_argument, build_checkpoint
from mmpipe.app.bench.timing import median

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array", "minItems": 10000,
            "items": {"type": "object",
                      "properties": {"name": {"type": "string", "maxLength": 16}, "score": {"type": "number"},
                                     "ok": {"type": "boolean"}},
                      "required": ["name", "score", "ok"]},
        },
    },
    "required": ["items"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_argument(parser)
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--batches", default="1,32,128", help="batch sizes, comma-separated")
    parser.add_argument("--short", type=int, default=8, help="output tokens of the short runs")
    parser.add_argument("--long", type=int, default=72, help="output tokens of the long runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median)")
    parser.add_argument("--tokenizer", default=None,
                        help="a saved full-vocabulary tokenizer to use (default: build one, about a minute)")


def full_vocab_tokenizer(size: int, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer of `size` tokens: Qwen's special tokens first (the synthetic
    tokenizer's ids), the 256 byte symbols, then merges of random printable pieces."""
    from mmpipe.app.tiny.synthetic import CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    printable = [s for s in sorted(alphabet) if s.isalnum() or s in "Ġ\"{}[]:,.-_"]
    rng = np.random.default_rng(seed)
    pieces, merges = list(printable), []
    while len(vocab) < size:
        a, b = pieces[rng.integers(len(pieces))], pieces[rng.integers(len(pieces))]
        if a + b in vocab or len(a + b) > 12:
            continue
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        pieces.append(a + b)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=QWEN_SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def with_full_vocab(weights: str, shape: str, tokenizer: str | None = None) -> str:
    """A folder beside the checkpoint: its files linked, its tokenizer replaced by a full-size one
    (`tokenizer`: a saved one, else built)."""
    path = weights.rstrip("/") + "-full-vocab"
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(weights):
        if not name.startswith("tokenizer") and not name.startswith("special_tokens") \
                and not os.path.exists(os.path.join(path, name)):
            os.symlink(os.path.join(os.path.abspath(weights), name), os.path.join(path, name))
    if tokenizer is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(path)
    else:
        full_vocab_tokenizer(SHAPES[shape].text["vocab_size"] - 256).save_pretrained(path)
    return path


def _decode_seconds(pipe: Any, batch: int, constrained: int, tokens: int) -> tuple[float, float]:
    """Wall seconds of one batch decoding `tokens` each, and the host seconds spent filling masks."""
    from mmpipe import SamplingParams
    from mmpipe.engine import model_runner

    free = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    json_row = SamplingParams(max_new_tokens=tokens, temperature=0.0, json_schema=SCHEMA)
    params = [json_row if i < constrained else free for i in range(batch)]
    prompts = [f"Item {i}: list the parts as JSON." for i in range(batch)]
    filled = [0.0]
    fill = model_runner.fill_masks

    def timed_fill(rows: Any, masks: Any) -> None:
        start = time.perf_counter()
        fill(rows, masks)
        filled[0] += time.perf_counter() - start

    model_runner.fill_masks = timed_fill
    try:
        start = time.perf_counter()
        outputs = pipe.generate(prompts, sampling=params)
        wall = time.perf_counter() - start
    finally:
        model_runner.fill_masks = fill
    short = [o for o in outputs if len(o.token_ids) != tokens]
    if short:
        raise RuntimeError(f"{len(short)} rows ended early ({short[0].finish_reason}, {short[0].error}): "
                           "the timing needs equal rows")
    return wall, filled[0]


def run_structured(args: argparse.Namespace) -> dict[str, Any]:
    from mmpipe import Pipeline

    weights = build_checkpoint(args.checkpoint or os.path.join(tempfile.gettempdir(), "mmpipe-3b-random"), args.shape)
    path = with_full_vocab(weights, args.shape, args.tokenizer)
    batches = [int(b) for b in args.batches.split(",")]
    rows, results = [], []
    steps = args.long - args.short
    with Pipeline.from_pretrained(path, device="cuda", max_running_requests=max(batches)) as pipe:
        for batch in batches:
            cell: dict[str, Any] = {"batch": batch}
            for name, constrained in (("free", 0), ("half", max(1, batch // 2))):
                _decode_seconds(pipe, batch, constrained, args.short)  # warm-up: graphs, grammar
                per_step, fills = [], []
                for _ in range(args.repeats):
                    short, _ = _decode_seconds(pipe, batch, constrained, args.short)
                    long, filled = _decode_seconds(pipe, batch, constrained, args.long)
                    per_step.append((long - short) / steps * 1e3)
                    fills.append(filled / args.long * 1e3)
                cell[f"{name}_ms_per_step"] = median(per_step)
                cell[f"{name}_mask_ms_per_step"] = median(fills)
                cell["constrained_rows" if name == "half" else "free_rows"] = constrained if name == "half" else 0
            cell["extra_ms_per_step"] = cell["half_ms_per_step"] - cell["free_ms_per_step"]
            results.append(cell)
            rows.append([batch, cell["constrained_rows"], cell["free_ms_per_step"], cell["half_ms_per_step"],
                         cell["extra_ms_per_step"], cell["half_mask_ms_per_step"]])
        graphs = pipe.stats()["decode"]
    print(table(f"Structured output: decode ms/step ({SHAPES[args.shape].label} shape, random weights, "
                f"vocabulary {SHAPES[args.shape].text['vocab_size']})",
                ["batch", "constrained rows", "free ms/step", "half constrained ms/step", "extra ms/step",
                 "mask filling ms/step (host)"], rows))
    return {"rows": results, "decode_graph_runs": graphs["graph_runs"], "decode_eager_runs": graphs["eager_runs"]}
