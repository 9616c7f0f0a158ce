"""`mmpipe bench decode`: the language model's decode speed, side by side, in one process.

    python -m mmpipe.app.bench decode                       # 3B shape, batches 1, 8, 32, 128
    python -m mmpipe.app.bench decode --shape 7b --plot decode.png --json decode.json
    mmpipe bench decode --systems mmpipe-eager,mmpipe-graphs --batches 1,32

Systems: transformers `generate` with its default (dynamic) cache; transformers `generate` with a
static cache and torch.compile (reduce-overhead); mmpipe with graphs off (`graph_mode="none"`);
mmpipe with its default CUDA graphs (`graph_mode="full_and_piecewise"`). Every request is a
text-only prompt of `--prompt-tokens` token ids (the same ids for every system) and generates a
fixed number of tokens (EOS ignored).

Decode time per step is measured by differencing: each batch runs with N1 and with N2 new tokens
and ms/step = (t(N2) - t(N1)) / (N2 - N1) (medians of the repeats), which cancels prefill and
per-call setup. The bandwidth floor of a step is the bytes it must read (every LM weight except
an untied input embedding, plus the KV cache at the mean context) over the device-to-device copy
bandwidth measured in the same run.

Everything that does not need a GPU (argument parsing, the floor, the differencing, tables, the
plot, and with `--device cpu` even the measurement loops on a tiny checkpoint) runs on a CPU, for
the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch
from mmpipe.app.bench.main import table
from mmpipe.app.bench.shapes import SHAPES, add_shape_argument, build_checkpoint, default_checkpoint_dir

SYSTEMS = ("hf", "hf-static", "mmpipe-eager", "mmpipe-graphs")
LABELS = {"hf": "transformers (dynamic cache)",
          "hf-static": "transformers (static cache + compile)",
          "mmpipe-eager": "mmpipe eager",
          "mmpipe-graphs": "mmpipe graphs"}
GRAPH_MODES = {"mmpipe-eager": "none", "mmpipe-graphs": "full_and_piecewise"}
NA = "n/a"


# ---------------------------------------------------------------------------- arguments

def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def system_list(text: str) -> list[str]:
    names = [v for v in str(text).replace(" ", "").split(",") if v]
    bad = [n for n in names if n not in SYSTEMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in names]  # fixed order: the baselines first


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `decode` subcommand's options (bench.py adds --json to every subcommand)."""
    add_shape_argument(parser)
    parser.add_argument("--batches", type=int_list, default=[1, 8, 32, 128],
                        help="comma-separated batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int_list, default=[32, 160], help="N1,N2 for the differencing")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each N per (system, batch); transformers' dynamic cache uses "
                             "one fewer, and a third of them at batch >= 128")
    parser.add_argument("--systems", type=system_list, default=list(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--kv-pages", type=int, default=None, help="mmpipe KV pages (default: sized for the "
                                                                   "largest batch)")
    parser.add_argument("--plot", default=None, help="write tokens/s and %% of floor vs batch to this PNG")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": tests only
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)


def check_args(args: argparse.Namespace) -> None:
    if len(args.new_tokens) != 2 or args.new_tokens[0] >= args.new_tokens[1]:
        raise SystemExit(f"--new-tokens {args.new_tokens}: give two counts N1 < N2")
    if args.prompt_tokens <= 0 or args.repeats <= 0:
        raise SystemExit("--prompt-tokens and --repeats must be positive")


# ---------------------------------------------------------------------------- pure arithmetic

def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a Qwen-VL config.json (nested or flat)."""
    text = dict(config.get("text_config") or config)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def head_dim_of(text: dict[str, Any]) -> int:
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def lm_weight_params(text: dict[str, Any]) -> int:
    """Parameters a decode step reads: every decoder layer (q/k/v with biases, o, gate/up/down, two
    norms), the final norm and the LM head. The input embedding is not counted: a step gathers B
    rows of it. A tied head is the embedding matrix and is counted once, as the head."""
    h, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    heads, kv_heads, dim = text["num_attention_heads"], text["num_key_value_heads"], head_dim_of(text)
    q, kv = heads * dim, kv_heads * dim
    bias = bool(text.get("attention_bias", True))  # Qwen2: q/k/v biases; Qwen3: none (its configs say so)
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if bias else 0)
    mlp = 3 * h * inter
    per_layer = attention + mlp + 2 * h
    return layers * per_layer + h + text["vocab_size"] * h


def kv_bytes_per_step(text: dict[str, Any], batch: int, context: float, elem_bytes: int = 2) -> float:
    """K and V of every layer over `context` tokens for each of `batch` sequences."""
    return batch * context * text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim_of(text) \
        * elem_bytes


def mean_context(prompt_tokens: int, n1: int, n2: int) -> float:
    return prompt_tokens + (n1 + n2) / 2


def floor_ms(text: dict[str, Any], batch: int, context: float, copy_gbs: float, elem_bytes: int = 2) -> float:
    """Bytes one decode step must read over the copy bandwidth (GB/s, read + write counted)."""
    total = lm_weight_params(text) * elem_bytes + kv_bytes_per_step(text, batch, context, elem_bytes)
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


# ---------------------------------------------------------------------------- results -> text

def fmt(value: Any, spec: str = ".3g", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NA
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:{spec}}{suffix}"
    return str(value)


def speedup(base_ms: float | None, ms: float | None) -> str:
    return f"{base_ms / ms:.2f}x" if base_ms and ms and base_ms > 0 and ms > 0 else NA


def result_rows(rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """The main table: one line per (system, batch)."""
    base = {(r["system"], r["batch"]): r.get("ms_per_step") for r in rows}
    out = []
    for r in rows:
        ms = r.get("ms_per_step")
        if r.get("error"):
            out.append([LABELS.get(r["system"], r["system"]), r["batch"], "error: " + _short(r["error"])]
                       + [""] * 7)
            continue
        out.append([LABELS.get(r["system"], r["system"]), r["batch"], fmt(ms, ".3g"),
                    fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("floor_ms"), ".3g"),
                    fmt(r.get("pct_of_floor"), ".0f", "%"), fmt(r.get("host_us_per_step"), ".0f"),
                    speedup(base.get(("hf", r["batch"])), ms),
                    speedup(base.get(("hf-static", r["batch"])), ms),
                    r.get("note") or ""])
    return out


RESULT_HEADER = ["system", "batch", "ms/step", "tok/s", "floor ms", "% of floor", "host µs/step",
                 "vs transformers", "vs transformers static+compile", "note"]
GRAPH_HEADER = ["system", "graph mode (reported)", "start-up s", "first call s", "capture s", "graph MiB",
                "largest bucket alone MiB", "graphs", "replays (timed)", "eager decode steps (timed)"]


def graph_rows(mmpipe: dict[str, dict[str, Any]]) -> list[list[Any]]:
    return [[LABELS.get(system, system), info.get("graph_mode_reported") or NA,
             fmt(info.get("startup_s"), ".1f"), fmt(info.get("first_call_s"), ".1f"),
             fmt(info.get("capture_s"), ".2f"), fmt(info.get("memory_MiB"), ".0f"),
             fmt(info.get("largest_alone_MiB"), ".0f"), fmt(info.get("graphs"), ""), fmt(info.get("replays"), ""), fmt(info.get("eager_steps"), "")]
            for system, info in mmpipe.items()]


def header_line(result: dict[str, Any]) -> str:
    n1, n2 = result["new_tokens"]
    return (f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}; "
            f"device-to-device copy {result['copy_GBps']:.0f} GB/s (read + write); "
            f"{SHAPES[result['shape']].label}-shaped LM, random weights, {result['dtype']}; "
            f"{result['prompt_tokens']}-token prompts, ms/step = (t({n2}) - t({n1})) / {n2 - n1} new tokens; "
            f"floor = ({result['lm_weight_bytes'] / 1e9:.2f} GB of LM weights + KV at context "
            f"{result['mean_context']:g}) / copy bandwidth")


def report(result: dict[str, Any]) -> str:
    text = header_line(result) + "\n\n"
    text += table("Decode speed", RESULT_HEADER, result_rows(result["rows"]))
    if result.get("mmpipe"):
        text += "\n" + table("mmpipe start-up and decode graphs", GRAPH_HEADER, graph_rows(result["mmpipe"]))
    return text


def _short(message: str, limit: int = 160) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def plot(result: dict[str, Any], path: str) -> bool:
    """tokens/s and % of floor vs batch (log x) per system; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install 'mmpipe[bench]'); no plot written",
              file=sys.stderr)
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    batches = sorted({r["batch"] for r in result["rows"]})
    for system in SYSTEMS:
        points = sorted((r["batch"], r.get("tokens_per_s"), r.get("pct_of_floor")) for r in result["rows"]
                        if r["system"] == system and r.get("tokens_per_s"))
        if not points:
            continue
        xs = [p[0] for p in points]
        left.plot(xs, [p[1] for p in points], marker="o", label=LABELS[system])
        right.plot(xs, [p[2] for p in points], marker="o", label=LABELS[system])
    for ax, ylabel in ((left, "decode tokens/s"), (right, "% of bandwidth floor")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches or [1])
        ax.set_xticklabels([str(b) for b in batches or [1]])
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    left.set_yscale("log")
    right.set_ylim(bottom=0)
    left.legend(fontsize=8)
    fig.suptitle(f"Decode, {SHAPES[result['shape']].label}-shaped LM, {result['dtype']}, "
                 f"{result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- checkpoint and prompts

def read_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as handle:
        return json.load(handle)


def make_prompts(path: str, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` random ordinary (non-special) token ids of the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(ordinary), (batch, length), generator=generator)
    return [[ordinary[int(i)] for i in row] for row in picks]


# ---------------------------------------------------------------------------- systems

class HFSystem:
    """transformers `generate` on token ids, dynamic cache or static cache + torch.compile."""

    def __init__(self, model: Any, device: torch.device, static: bool, max_cache_len: int) -> None:
        self.model, self.device, self.static, self.max_cache_len = model, device, static, max_cache_len
        self.fullgraph = True
        self.note = ""

    def compile_config(self) -> Any:
        from transformers import CompileConfig

        if self.device.type == "cuda":
            return CompileConfig(fullgraph=self.fullgraph, mode="reduce-overhead")
        # CPU (tests): trace with dynamo but run eagerly, so the same generate path is exercised.
        config = CompileConfig(fullgraph=self.fullgraph, backend="eager", mode=None)
        config._compile_all_devices = True
        return config

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0, top_k=None, top_p=None, temperature=None)
        if self.static:
            # One cache length for every call, so N1 and N2 runs replay the same compiled graph and
            # attend over the same (masked) static cache.
            kwargs.update(cache_implementation="static", compile_config=self.compile_config(),
                          max_cache_len=self.max_cache_len)
        out = self.model.generate(**kwargs)  # generate runs under no_grad itself
        if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
            raise RuntimeError(f"transformers generated {tuple(out.shape)}, expected "
                               f"{(ids.shape[0], ids.shape[1] + new_tokens)}")

    def first_run(self, prompts: list[list[int]], new_tokens: int) -> None:
        """The warm-up; with compile, a fullgraph failure retries once with fullgraph=False."""
        try:
            self.run(prompts, new_tokens)
        except Exception as exc:  # dynamo/inductor raise many types
            if not (self.static and self.fullgraph):
                raise
            self.fullgraph = False
            self.note = f"fullgraph=False (fullgraph=True failed: {_short(repr(exc), 100)})"
            print(f"  transformers static+compile: fullgraph=True failed ({_short(repr(exc), 300)}); "
                  "retrying with fullgraph=False", file=sys.stderr)
            _reset_compile()
            self.run(prompts, new_tokens)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.model.__dict__.pop("_compiled_call", None)
        self.model = None


class MmpipeSystem:
    """mmpipe's engine on token-id requests (text only), graph mode chosen."""

    def __init__(self, path: str, device: torch.device, dtype: str, graph_mode: str, num_kv_pages: int,
                 max_running_requests: int) -> None:
        from mmpipe import Pipeline

        options: dict[str, Any] = dict(num_kv_pages=num_kv_pages, max_running_requests=max_running_requests,
                                       graph_mode=graph_mode)
        self.note = ""
        _sync(device)
        start = time.perf_counter()
        self.pipe = Pipeline.from_pretrained(path, device=str(device), dtype=dtype, **options)
        _sync(device)
        self.startup_s = time.perf_counter() - start
        self.graph_mode = graph_mode

    def _requests(self, prompts: list[list[int]], params: Any) -> list[Any]:
        from mmpipe.engine.processor import Prepared

        pipe = self.pipe
        sampling = params.resolve(pipe.defaults)
        return [pipe.processor.assemble(Prepared(i, f"prompt {i}", list(ids), [], sampling, False), [])
                for i, ids in enumerate(prompts)]

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        from mmpipe import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)
        requests = self._requests(prompts, params)
        engine = self.pipe.engine
        with engine.lock:
            try:
                for request in requests:
                    engine.add(request)
                while any(not r.finished for r in requests):
                    engine.step()
            except BaseException:  # leave the engine empty for the next measurement
                for request in requests:
                    engine.abort(request)
                raise
        results = [(r.finish_reason, len(r.output_ids), r.error) for r in requests]
        bad = [r for r in results if r[0] != "length" or r[1] != new_tokens]
        if bad:
            raise RuntimeError(f"mmpipe: {len(bad)} request(s) did not generate {new_tokens} tokens "
                               f"(finish reason, tokens, error): {bad[:3]}")

    def first_run(self, prompts: list[list[int]], new_tokens: int) -> None:
        self.run(prompts, new_tokens)

    def stats(self) -> dict[str, Any]:
        return _plain(self.pipe.stats())

    def preemptions(self) -> int | None:
        return self.pipe.engine.scheduler.preemptions

    def close(self) -> None:
        self.pipe.close()
        self.pipe = None


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a stats dict (dataclasses and enums turned into plain values)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raise_recompile_limit(limit: int) -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))
            return


def _reset_compile() -> None:
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    try:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except Exception:
        pass


def _free(device: torch.device) -> None:
    """Release what the last system left (never raises: it also runs after a failure)."""
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        except Exception as exc:  # a sticky CUDA error: the next system will report it too
            print(f"  freeing GPU memory failed: {exc!r}", file=sys.stderr)


def wall_s(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(system: Any, prompts: list[list[int]], n1: int, n2: int, repeats: int, device: torch.device,
            warm: bool) -> dict[str, Any]:
    """Warm up (unless `warm`), then `repeats` alternating runs of N1 and N2 new tokens."""
    first = None if warm else wall_s(lambda: system.first_run(prompts, n1), device)
    t1, t2 = [], []
    for _ in range(repeats):
        t1.append(wall_s(lambda: system.run(prompts, n1), device))
        t2.append(wall_s(lambda: system.run(prompts, n2), device))
    return {"t1_s": t1, "t2_s": t2, "first_call_s": first, "ms_per_step": ms_per_step(t1, t2, n1, n2)}


# ---------------------------------------------------------------------------- the run

def copy_gbs_of(device: torch.device) -> float:
    if device.type == "cuda":
        from mmpipe.app.bench.main import copy_bandwidth

        return copy_bandwidth()
    x = torch.empty(1 << 26, dtype=torch.uint8).random_(0, 255)  # CPU (tests): a rough figure
    y = torch.empty_like(x)
    y.copy_(x)
    seconds = min(wall_s(lambda: y.copy_(x), device) for _ in range(3))
    return 2 * x.numel() / seconds / 1e9


def _log(start: float, message: str) -> None:
    print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    check_args(args)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    clock = time.perf_counter()
    n1, n2 = args.new_tokens
    batches = list(args.batches)
    path = build_checkpoint(args.checkpoint or default_checkpoint_dir(args.shape), args.shape, str(device))
    _log(clock, f"checkpoint {path}")
    text = text_config_of(read_config(path))
    elem = torch.empty(0, dtype=_torch_dtype(args.dtype)).element_size()
    context = mean_context(args.prompt_tokens, n1, n2)
    copy_gbs = copy_gbs_of(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result: dict[str, Any] = {
        "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
        "copy_GBps": copy_gbs, "shape": args.shape, "dtype": args.dtype, "checkpoint": path,
        "prompt_tokens": args.prompt_tokens, "new_tokens": [n1, n2], "batches": batches,
        "repeats": args.repeats, "systems": list(args.systems), "mean_context": context,
        "lm_weight_params": lm_weight_params(text), "lm_weight_bytes": lm_weight_params(text) * elem,
        "rows": [], "mmpipe": {}}
    _log(clock, f"{device_name}: copy {copy_gbs:.0f} GB/s; LM weights "
                f"{result['lm_weight_bytes'] / 1e9:.2f} GB")
    prompts = make_prompts(path, max(batches), args.prompt_tokens)

    def add_row(system: str, batch: int, **fields: Any) -> dict[str, Any]:
        row = {"system": system, "label": LABELS[system], "batch": batch,
               "floor_ms": floor_ms(text, batch, context, copy_gbs, elem), **fields}
        ms = row.get("ms_per_step")
        row["tokens_per_s"] = tokens_per_s(batch, ms)
        row["pct_of_floor"] = 100 * row["floor_ms"] / ms if ms and ms > 0 else None
        if ms is not None and ms <= 0:
            row["note"] = "; ".join(filter(None, [row.get("note"), "t(N2) <= t(N1): timing noise, use more "
                                                                   "--repeats or a larger N2"]))
        result["rows"].append(row)
        if row.get("error"):
            _log(clock, f"{system} batch {batch}: error {_short(row['error'], 300)}")
        else:
            _log(clock, f"{system} batch {batch}: {fmt(ms)} ms/step, {fmt(row['tokens_per_s'], ',.0f')} "
                        f"tok/s, {fmt(row['pct_of_floor'], '.0f')}% of floor")
        return row

    hf_systems = [s for s in args.systems if s.startswith("hf")]
    if hf_systems:
        from mmpipe.app.tiny.synthetic import model_class
        from transformers import AutoConfig

        _raise_recompile_limit(64)  # one compile per batch shape, plus automatic-dynamic ones
        model = model_class(AutoConfig.from_pretrained(path, local_files_only=True)).from_pretrained(
            path, dtype=_torch_dtype(args.dtype))
        model = model.to(device).eval()
        _log(clock, "transformers model loaded")
        for system in hf_systems:
            hf = HFSystem(model, device, static=system == "hf-static",
                          max_cache_len=args.prompt_tokens + n2 + 1)
            for batch in batches:
                try:
                    repeats = repeats_for(system, batch, args.repeats)
                    timing = measure(hf, prompts[:batch], n1, n2, repeats, device, warm=False)
                    add_row(system, batch, **timing, note=hf.note)
                except Exception as exc:  # a compile or memory failure: record it, go on
                    add_row(system, batch, error=f"{type(exc).__name__}: {exc}", note=hf.note)
                    _free(device)
            hf.close()
            if system == "hf-static":
                _reset_compile()
            _free(device)
            save_partial(args, result)
        del model, hf
        _free(device)

    from mmpipe.config import EngineConfig

    page_size = EngineConfig().kv_page_size
    pages = args.kv_pages or kv_pages_needed(max(batches), args.prompt_tokens, n2, page_size)
    for system in (s for s in args.systems if s.startswith("mmpipe")):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            mm = MmpipeSystem(path, device, args.dtype, GRAPH_MODES[system], pages, max(batches))
        except Exception as exc:
            for batch in batches:
                add_row(system, batch, error=f"start-up: {type(exc).__name__}: {exc}")
            _free(device)
            continue
        info: dict[str, Any] = {"graph_mode": GRAPH_MODES[system], "startup_s": mm.startup_s,
                                "kv_pages": pages, "per_batch": {}}
        _log(clock, f"{system}: Pipeline.from_pretrained {mm.startup_s:.1f} s")
        first_call = None
        for batch in batches:
            try:
                # Warm-up outside the stats window (it may capture lazily), then the timed runs.
                batch_prompts = prompts[:batch]
                warmup_s = wall_s(lambda: mm.first_run(batch_prompts, n1), device)  # noqa: B023 (called here)
                first_call = warmup_s if first_call is None else first_call
                pre = mm.preemptions()
                before = mm.stats()
                timing = measure(mm, batch_prompts, n1, n2, args.repeats, device, warm=True)
                after = mm.stats()
                summary = graph_summary(after, numeric_delta(before, after))
                preempted = (mm.preemptions() or 0) - (pre or 0) if pre is not None else None
                note = mm.note + (f"; {preempted} preemptions" if preempted else "")
                add_row(system, batch, **timing, warmup_s=warmup_s, preemptions=preempted,
                        note=note.strip("; "), host_us_per_step=summary["host_us_per_step"],
                        replays=summary["replays"], eager_steps=summary["eager_steps"])
                info["per_batch"][batch] = summary
            except Exception as exc:
                add_row(system, batch, error=f"{type(exc).__name__}: {exc}", note=mm.note)
        after = mm.stats()
        summary = graph_summary(after, {})
        info.update(first_call_s=first_call, capture_s=summary["capture_s"], memory_MiB=summary["memory_MiB"],
                    graphs=summary["graphs"], stats=after, graph_mode_reported=after.get("graph_mode"),
                    **{key: sum_known(s.get(key) for s in info["per_batch"].values())
                       for key in ("replays", "eager_steps")})
        if device.type == "cuda":
            info["peak_memory_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["mmpipe"][system] = info
        mm.close()
        mm = None
        _free(device)
        if GRAPH_MODES[system] != "none" and device.type == "cuda":
            info["largest_alone_MiB"] = largest_bucket_alone_MiB(path, device, args.dtype, pages, max(batches))
            _free(device)
        save_partial(args, result)

    result["report"] = report(result)
    _log(clock, "done")
    print(result["report"])
    if args.plot:
        if plot(result, args.plot):
            print(f"plot written to {args.plot}")
    return result


def largest_bucket_alone_MiB(path: str, device: torch.device, dtype: str, pages: int, max_batch: int) -> float | None:
    """Decode-graph memory with only the largest bucket captured: the yardstick for the memory of
    all buckets sharing one pool."""
    from mmpipe import GraphConfig, Pipeline

    pipe = Pipeline.from_pretrained(path, device=str(device), dtype=dtype, num_kv_pages=pages,
                                    max_running_requests=max_batch, graph_mode="full_decode_only",
                                    decode_graph=GraphConfig(buckets=(max_batch,)))
    memory = dig(pipe.stats(), "decode", "memory_bytes")
    pipe.close()
    return memory / 2**20 if isinstance(memory, (int, float)) else None


def save_partial(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write what is measured so far to --json after each system (a crash keeps the earlier ones);
    the caller writes the complete result at the end."""
    if getattr(args, "json", None):
        with open(args.json, "w") as handle:
            json.dump(dict(result, partial=True), handle, indent=2)


def _torch_dtype(name: str) -> torch.dtype:
    from mmpipe.config import resolve_dtype

    return resolve_dtype(name, torch.device("cpu"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmpipe.app.bench.decode",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    from mmpipe.app.bench.main import write_json

    write_json(args.json, run_decode(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
