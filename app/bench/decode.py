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
import json
import sys
import time
from typing import Any

import torch
from mmpipe.app.bench.decode_math import (
    dig,
    floor_ms,
    graph_summary,
    kv_pages_needed,
    lm_weight_params,
    mean_context,
    numeric_delta,
    repeats_for,
    sum_known,
    text_config_of,
    tokens_per_s,
)
from mmpipe.app.bench.decode_report import fmt, plot, report
from mmpipe.app.bench.decode_systems import (
    GRAPH_MODES,
    SYSTEMS,
    HFSystem,
    MmpipeSystem,
    free_memory,
    gpus_of,
    label_of,
    make_prompts,
    measure,
    raise_recompile_limit,
    read_config,
    reset_compile,
    short,
)
from mmpipe.app.bench.results import write_json
from mmpipe.app.bench.shapes import (
    add_layers_argument,
    add_shape_argument,
    build_checkpoint,
    default_checkpoint_dir,
)
from mmpipe.app.bench.timing import copy_bandwidth, wall_s


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


def layout_list(text: str) -> list[str]:
    """`1`, `tpN` (tensor parallel over N GPUs) or `epN` (the same with experts split whole)."""
    names = [v for v in str(text).replace(" ", "").split(",") if v]
    bad = [n for n in names if n != "1" and not (n[:2] in ("tp", "ep") and n[2:].isdigit() and int(n[2:]) >= 2)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1, tpN or epN (N >= 2 GPUs), comma-separated")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `decode` subcommand's options (`bench.main` adds --json to every subcommand)."""
    add_shape_argument(parser)
    add_layers_argument(parser)
    parser.add_argument("--parallel", type=layout_list, default=["1"],
                        help="mmpipe on one GPU (1), tensor parallel over N GPUs (tpN) or expert parallel "
                             "(epN: a mixture of experts' experts split whole), each in turn; default: 1")
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
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="mmpipe's language model (experts too) in FP8; the floor counts those weights at one byte")
    parser.add_argument("--plot", default=None, help="write tokens/s and %% of floor vs batch to this PNG")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": tests only
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)


def check_args(args: argparse.Namespace) -> None:
    if len(args.new_tokens) != 2 or args.new_tokens[0] >= args.new_tokens[1]:
        raise SystemExit(f"--new-tokens {args.new_tokens}: give two counts N1 < N2")
    if args.prompt_tokens <= 0 or args.repeats <= 0:
        raise SystemExit("--prompt-tokens and --repeats must be positive")


def copy_gbs_of(device: torch.device) -> float:
    if device.type == "cuda":
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
    path = build_checkpoint(args.checkpoint or default_checkpoint_dir(args.shape, args.layers), args.shape, str(device),
                            args.layers)
    _log(clock, f"checkpoint {path}")
    text = text_config_of(read_config(path))
    elem = torch.empty(0, dtype=_torch_dtype(args.dtype)).element_size()
    fp8 = args.quantization == "fp8"
    context = mean_context(args.prompt_tokens, n1, n2)
    copy_gbs = copy_gbs_of(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result: dict[str, Any] = {
        "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
        "copy_GBps": copy_gbs, "shape": args.shape, "layers": text["num_hidden_layers"], "dtype": args.dtype,
        "quantization": args.quantization, "checkpoint": path, "parallel": list(args.parallel),
        "prompt_tokens": args.prompt_tokens, "new_tokens": [n1, n2], "batches": batches,
        "repeats": args.repeats, "systems": list(args.systems), "mean_context": context,
        "lm_weight_params": lm_weight_params(text), "lm_weight_bytes": lm_weight_params(text) * elem,
        "rows": [], "mmpipe": {}}
    _log(clock, f"{device_name}: copy {copy_gbs:.0f} GB/s; LM weights "
                f"{result['lm_weight_bytes'] / 1e9:.2f} GB")
    prompts = make_prompts(path, max(batches), args.prompt_tokens)

    def add_row(system: str, batch: int, **fields: Any) -> dict[str, Any]:
        gpus = gpus_of(system)  # the floor: the step's bytes read by that many GPUs at once
        row = {"system": system, "label": label_of(system), "batch": batch,
               "floor_ms": floor_ms(text, batch, context, copy_gbs * gpus, elem,
                                    fp8=fp8 and system.startswith("mmpipe")),
               **fields}
        ms = row.get("ms_per_step")
        row["tokens_per_s"] = tokens_per_s(batch, ms)
        row["pct_of_floor"] = 100 * row["floor_ms"] / ms if ms and ms > 0 else None
        if ms is not None and ms <= 0:
            row["note"] = "; ".join(filter(None, [row.get("note"), "t(N2) <= t(N1): timing noise, use more "
                                                                   "--repeats or a larger N2"]))
        result["rows"].append(row)
        if row.get("error"):
            _log(clock, f"{system} batch {batch}: error {short(row['error'], 300)}")
        else:
            _log(clock, f"{system} batch {batch}: {fmt(ms)} ms/step, {fmt(row['tokens_per_s'], ',.0f')} "
                        f"tok/s, {fmt(row['pct_of_floor'], '.0f')}% of floor")
        return row

    hf_systems = [s for s in args.systems if s.startswith("hf")]
    if hf_systems:
        from mmpipe.app.tiny.synthetic import model_class
        from transformers import AutoConfig

        raise_recompile_limit(64)  # one compile per batch shape, plus automatic-dynamic ones
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
                    free_memory(device)
            hf.close()
            if system == "hf-static":
                reset_compile()
            free_memory(device)
            save_partial(args, result)
        del model, hf
        free_memory(device)

    from mmpipe.config import EngineConfig

    page_size = EngineConfig().kv_page_size
    pages = args.kv_pages or kv_pages_needed(max(batches), args.prompt_tokens, n2, page_size)
    mmpipe_systems = [s for s in args.systems if s.startswith("mmpipe")]
    for system in (f"{s}@{layout}" if layout != "1" else s for layout in args.parallel for s in mmpipe_systems):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        mode = GRAPH_MODES[system.split("@")[0]]
        try:
            mm = MmpipeSystem(path, device, args.dtype, mode, pages, max(batches), args.quantization,
                              tensor_parallel_size=gpus_of(system), expert_parallel="@ep" in system)
        except Exception as exc:
            for batch in batches:
                add_row(system, batch, error=f"start-up: {type(exc).__name__}: {exc}")
            free_memory(device)
            continue
        info: dict[str, Any] = {"graph_mode": mode, "startup_s": mm.startup_s,
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
        free_memory(device)
        if mode != "none" and device.type == "cuda" and gpus_of(system) == 1:
            info["largest_alone_MiB"] = largest_bucket_alone_MiB(path, device, args.dtype, pages, max(batches))
            free_memory(device)
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
    from mmpipe.app.bench.shapes import load_options

    from mmpipe import GraphConfig, Pipeline

    pipe = Pipeline.from_pretrained(path, device=str(device), dtype=dtype, num_kv_pages=pages, **load_options(path),
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
    write_json(args.json, run_decode(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
