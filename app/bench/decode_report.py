"""`mmpipe bench decode`'s results as text and a plot: the decode-speed table (ms per step, tokens
per second, share of the bandwidth floor, speed-ups over both `transformers` systems), the table of
mmpipe's start-up and decode graphs, and tokens/s and % of floor against the batch size."""

from __future__ import annotations

import math
import sys
from typing import Any, Sequence

from mmpipe.app.bench.decode_systems import label_of, short
from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import SHAPES

NA = "n/a"


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
            out.append([label_of(r["system"]), r["batch"], "error: " + short(r["error"])]
                       + [""] * 7)
            continue
        out.append([label_of(r["system"]), r["batch"], fmt(ms, ".3g"),
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
    return [[label_of(system), info.get("graph_mode_reported") or NA,
             fmt(info.get("startup_s"), ".1f"), fmt(info.get("first_call_s"), ".1f"),
             fmt(info.get("capture_s"), ".2f"), fmt(info.get("memory_MiB"), ".0f"),
             fmt(info.get("largest_alone_MiB"), ".0f"), fmt(info.get("graphs"), ""), fmt(info.get("replays"), ""), fmt(info.get("eager_steps"), "")]
            for system, info in mmpipe.items()]


def header_line(result: dict[str, Any]) -> str:
    n1, n2 = result["new_tokens"]
    return (f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}; "
            f"device-to-device copy {result['copy_GBps']:.0f} GB/s (read + write); "
            f"{SHAPES[result['shape']].label}-shaped LM{depth_note(result)}, random weights, {result['dtype']}"
            f"{'; mmpipe in ' + result['quantization'] + ' (those weights at one byte in its floor)' if result.get('quantization') else ''}; "
            f"{result['prompt_tokens']}-token prompts, ms/step = (t({n2}) - t({n1})) / {n2 - n1} new tokens; "
            f"floor = ({result['lm_weight_bytes'] / 1e9:.2f} GB of LM weights + KV at context "
            f"{result['mean_context']:g}) / copy bandwidth (x N for a system on N GPUs)")


def depth_note(result: dict[str, Any]) -> str:
    layers, full = result.get("layers"), SHAPES[result["shape"]].text["num_hidden_layers"]
    return f" cut to {layers} of its {full} layers" if layers and layers != full else ""


def report(result: dict[str, Any]) -> str:
    text = header_line(result) + "\n\n"
    text += table("Decode speed", RESULT_HEADER, result_rows(result["rows"]))
    if result.get("mmpipe"):
        text += "\n" + table("mmpipe start-up and decode graphs", GRAPH_HEADER, graph_rows(result["mmpipe"]))
    return text


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
    for system in dict.fromkeys(r["system"] for r in result["rows"]):
        points = sorted((r["batch"], r.get("tokens_per_s"), r.get("pct_of_floor")) for r in result["rows"]
                        if r["system"] == system and r.get("tokens_per_s"))
        if not points:
            continue
        xs = [p[0] for p in points]
        left.plot(xs, [p[1] for p in points], marker="o", label=label_of(system))
        right.plot(xs, [p[2] for p in points], marker="o", label=label_of(system))
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
