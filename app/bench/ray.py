"""`mmpipe bench ray`: the Ray Data stage (`mmpipe caption --ray`) against `mmpipe caption` on the
same JPEG files, on one machine, every run a new process timed from the command to its exit.

Both pay a fixed start (the Pipeline's; the Ray job also starts a local cluster and an actor), so
two file counts are run: files / wall for each, and the marginal rate between the smallest and
the largest count, (n2 - n1) / (wall2 - wall1): the images/s a long job runs at once its start is
paid, the figure that decides a million-image job's time. Each Ray run checks that its output
holds every file exactly once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import add_shape_argument, build_checkpoint
from mmpipe.app.bench.startup import cache_env, child_env, run_child


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", default="1024,3072", help="comma-separated file counts (448 px JPEGs)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--variants", default="64x2,128x4",
                        help="comma-separated Ray batchings, BATCHxIN_FLIGHT (--ray-batch-size, "
                             "--ray-batches-in-flight)")
    parser.add_argument("--caption-args", default="", help="extra arguments for both commands")
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--workdir", default=None, help="where the JPEG files and outputs go")
    parser.add_argument("--cache-root", default=None, help="the compile caches live here")
    add_shape_argument(parser)


def marginal_rate(runs: list[dict[str, Any]]) -> float | None:
    """Files per second between the smallest and the largest file count of one system."""
    if len({r["files"] for r in runs}) < 2:
        return None
    low, high = min(runs, key=lambda r: r["files"]), max(runs, key=lambda r: r["files"])
    return (high["files"] - low["files"]) / (high["wall_s"] - low["wall_s"])


def _rows_once(output: str, folder: str, count: int) -> None:
    from mmpipe.integrations.ray_data import image_files, written_rows

    paths = [row["path"] for row in written_rows(output, ["path"])]
    if len(paths) != count or sorted(paths) != image_files(folder):
        raise RuntimeError(f"{output}: {len(paths)} rows ({len(set(paths))} files) for {count} files")


def run_ray(args: argparse.Namespace) -> dict[str, Any]:
    from mmpipe.app.bench.caption import write_jpegs

    ckpt = build_checkpoint(args.checkpoint, args.shape)
    work = args.workdir or os.path.abspath("mmpipe-bench-ray")
    env = child_env(None, cache_env(args.cache_root or os.path.join(work, "caches")))
    counts = [int(c) for c in args.files.split(",") if c.strip()]
    variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",") if v.strip()]
    common = ["--model", ckpt, "--max-new-tokens", str(args.new_tokens), "--min-new-tokens", str(args.new_tokens),
              *args.caption_args.split()]
    systems: dict[str, list[dict[str, Any]]] = {}

    def one(name: str, folder: str, count: int, extra: list[str], output: str) -> None:
        for path in (output, output + ".errors"):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        command = [sys.executable, "-m", "mmpipe.cli", "caption", folder, "--output", output, *common, *extra]
        # Random weights end many captions empty: error rows, exit code 1.
        wall, cpu, _, err = run_child(command, env, None, ok=(0, 1))
        if "--ray" in extra:
            _rows_once(output, folder, count)
        summary = [line for line in err.splitlines() if line.startswith("captioned ")]
        systems.setdefault(name, []).append({"files": count, "wall_s": wall, "cpu_s": cpu,
                                             "summary": summary[-1] if summary else ""})
        print(f"{name}, {count} files: {wall:.1f} s wall ({summary[-1] if summary else err[-300:]})", flush=True)

    folders = {count: os.path.join(work, f"jpeg{count}") for count in counts}
    for count, folder in folders.items():
        write_jpegs(folder, count)
    warm = os.path.join(work, "warm.jsonl")  # fills the compile caches: every figure is a second process
    one("warm-up", folders[counts[0]], counts[0], ["--format", "jsonl", "--errors-file", warm + ".errors"], warm)
    systems.pop("warm-up")
    for count in counts:
        folder = folders[count]
        one("mmpipe caption", folder, count, ["--format", "jsonl", "--errors-file",
                                              os.path.join(work, f"out{count}.jsonl.errors")],
            os.path.join(work, f"out{count}.jsonl"))
        for batch, in_flight in variants:
            one(f"--ray {batch}x{in_flight}", folder, count,
                ["--ray", "--ray-actors", "1", "--ray-batch-size", str(batch), "--ray-batches-in-flight",
                 str(in_flight)], os.path.join(work, f"ray{count}_{batch}x{in_flight}"))
    base = marginal_rate(systems["mmpipe caption"])
    rows = []
    for name, runs in systems.items():
        rate = marginal_rate(runs)
        rows.append([name, *[f"{r['wall_s']:.1f} s, {r['files'] / r['wall_s']:.1f}/s" for r in
                             sorted(runs, key=lambda r: r["files"])],
                     round(rate, 1) if rate else "", f"{rate / base:.2f}" if rate and base else ""])
    print(table(f"`mmpipe caption` vs `--ray --ray-actors 1` ({args.new_tokens} new tokens; wall from the command "
                "to exit, files / wall; marginal rate between the counts)",
                ["system", *[f"{c} files" for c in counts], "marginal files/s", "vs caption"], rows))
    return {"systems": systems, "marginal_files_per_s": {n: marginal_rate(r) for n, r in systems.items()}}
