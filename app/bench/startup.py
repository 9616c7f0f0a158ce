"""`mmpipe bench startup`: what a user waits for, from the command to the result, start-up included.

Every figure comes from a new Python process, as a user starts one:

1. `Pipeline.from_pretrained` to the first token of one 448 px image request (and the process's
   wall time from launch), with the pipeline's own start-up report (`pipe.startup_report()`,
   where the tree has one): on a "fresh machine" (empty Triton, inductor and mmpipe compile
   caches) and in a "second process" (the caches the first one filled).
2. `mmpipe caption DIR --format jsonl` on `--caption` JPEG folders (448 px, `--new-tokens`
   tokens each), second process: wall from launch to exit, files / wall, CPU seconds (user +
   system of the process and its children) per image, and captures after the first step.

`--tree PATH` runs the same processes from another checkout (two trees compared in one session:
run once with one tree, once with the other, on the same checkpoint and files).

`--bytecode DIR` caches the children's compiled bytecode under DIR (`PYTHONPYCACHEPREFIX`, and
`PYTHONDONTWRITEBYTECODE` unset), as a `pip install` leaves it; an empty DIR is filled first by
one untimed process. Where the environment sets `PYTHONDONTWRITEBYTECODE=1` over a venv without
`__pycache__`, every process compiles torch's, transformers' and mmpipe's sources again, a cost
no installed user pays; this flag leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import add_shape_argument, build_checkpoint

# Run in the child: one image request after from_pretrained, timings as JSON on the last line.
_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
from mmpipe import Pipeline, SamplingParams
t_import = time.perf_counter()
pipe = Pipeline.from_pretrained(sys.argv[1], startup_progress=False)
t_loaded = time.perf_counter()
conversation = [{"role": "user", "content": [{"type": "image", "image": sys.argv[2]},
                                             {"type": "text", "text": "Describe this image."}]}]
out = pipe.chat([conversation], SamplingParams(max_new_tokens=1, temperature=0))[0]
assert out.ok, out.error
t_first = time.perf_counter()
report = pipe.startup_report() if hasattr(pipe, "startup_report") else None
stats = pipe.stats()
graphs = {name: {k: stats[name].get(k) for k in ("graphs", "captures", "startup_seconds", "capture_seconds")}
          for name in ("vit", "prefill", "decode")}
print(json.dumps({"import_s": t_import - t0, "from_pretrained_s": t_loaded - t_import,
                  "first_token_s": t_first - t_loaded, "to_first_token_s": t_first - t_import,
                  "report": report, "graphs": graphs}))
pipe.close()
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", default="fresh,second", help="comma-separated: fresh (empty caches), second")
    parser.add_argument("--caption", default="64,1024", help="comma-separated file counts for `mmpipe caption` "
                        "(second process; empty: none)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--caption-args", default="", help="extra `mmpipe caption` arguments")
    parser.add_argument("--tree", default=None, help="run this checkout's mmpipe instead of the installed one")
    parser.add_argument("--cache-root", default=None, help="the caches live here (default: a temporary folder)")
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--workdir", default=None, help="where the JPEG files go (default: a temporary folder)")
    parser.add_argument("--bytecode", default=None, help="cache the children's bytecode here, as an installed "
                        "package has it (default: as the environment says)")
    add_shape_argument(parser)


def cache_env(root: str) -> dict[str, str]:
    """Every compile cache a run fills, under `root` (a fresh root is a fresh machine)."""
    return {"TRITON_CACHE_DIR": os.path.join(root, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "MMPIPE_CACHE_DIR": os.path.join(root, "mmpipe")}


def child_env(tree: str | None, caches: dict[str, str], bytecode: str | None = None) -> dict[str, str]:
    env = dict(os.environ, **caches)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.abspath(bytecode)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def caption_rows(output: str, errors: str) -> tuple[int, int]:
    """(captions written, images whose caption came back empty) of a `mmpipe caption` run. Random
    weights often decode to an empty caption, which the tool reports as an error row after
    generating it: such images count. Any other error row is a failed run, raised here."""
    from mmpipe.captioning import EMPTY_CAPTION  # lazy: the bench's parent process needs no torch until here

    written = sum(1 for line in open(output) if line.strip()) if os.path.exists(output) else 0
    rows = [json.loads(line) for line in open(errors) if line.strip()] if os.path.exists(errors) else []
    other = [row for row in rows if not str(row.get("error", "")).endswith(EMPTY_CAPTION)]
    if other:
        raise RuntimeError(f"mmpipe caption: {len(other)} image(s) failed, e.g. {other[0]}")
    return written, len(rows)


def warm_bytecode(folder: str, command: list[str], env: dict[str, str], cwd: str | None) -> bool:
    """Fill an empty bytecode cache with one untimed run of `command` (else the first timed run
    pays the compile the cache is there to spare); True if it ran."""
    os.makedirs(folder, exist_ok=True)
    if os.listdir(folder):
        return False
    run_child(command, env, cwd)
    return True


def run_child(command: list[str], env: dict[str, str], cwd: str | None, ok: tuple[int, ...] = (0,)
              ) -> tuple[float, float, str, str]:
    """(wall s, CPU s of the process and its children, stdout, stderr); raises when the exit
    code is not in `ok`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in ok:
        raise RuntimeError(f"{' '.join(command[:4])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout, proc.stderr


def run_startup(args: argparse.Namespace) -> dict[str, Any]:
    from mmpipe.app.bench.caption import write_jpegs

    ckpt = build_checkpoint(args.checkpoint, args.shape)
    work = args.workdir or tempfile.mkdtemp(prefix="mmpipe-bench-startup-")
    root = args.cache_root or tempfile.mkdtemp(prefix="mmpipe-bench-caches-")
    caches = cache_env(root)
    env = child_env(args.tree, caches, args.bytecode)
    cwd = os.path.abspath(args.tree) if args.tree else None
    image = write_jpegs(os.path.join(work, "one"), 1)[0]
    if args.bytecode:
        # Throwaway compile caches: a "fresh" run below must still start without them.
        scratch = tempfile.mkdtemp(prefix="mmpipe-bench-bytecode-")
        warm_bytecode(args.bytecode, [sys.executable, "-c", _CHILD, ckpt, image],
                      child_env(args.tree, cache_env(scratch), args.bytecode), cwd)
        subprocess.run(["rm", "-rf", scratch], check=True)
    result: dict[str, Any] = {"tree": args.tree or "installed", "bytecode_cached": bool(args.bytecode)
                              or not os.environ.get("PYTHONDONTWRITEBYTECODE"), "startup": [], "caption": []}
    rows = []
    for run in [r for r in args.runs.split(",") if r]:
        if run == "fresh":
            subprocess.run(["rm", "-rf", root], check=True)
        wall, cpu, out, _ = run_child([sys.executable, "-c", _CHILD, ckpt, image], env, cwd)
        timings = json.loads(out.strip().splitlines()[-1])
        timings.update(run=run, process_wall_s=wall, cpu_s=cpu)
        result["startup"].append(timings)
        rows.append([run, round(wall, 1), round(timings["import_s"], 1), round(timings["from_pretrained_s"], 1),
                     round(timings["first_token_s"], 2), round(timings["to_first_token_s"], 1), round(cpu, 1)])
        if timings.get("report"):
            print(f"start-up report ({run}):\n{timings['report']}\n")
    print(table("From the command to the first token (one 448 px JPEG, one new token), s",
                ["run", "process wall", "import", "from_pretrained", "first request", "from_pretrained to first "
                 "token", "CPU s"], rows))
    rows = []
    for count in [int(c) for c in args.caption.split(",") if c.strip()]:
        folder = os.path.join(work, f"jpeg{count}")
        write_jpegs(folder, count)
        output = os.path.join(work, f"captions{count}.jsonl")
        errors = os.path.join(work, f"errors{count}.jsonl")
        for path in (output, errors):
            if os.path.exists(path):
                os.remove(path)
        command = [sys.executable, "-m", "mmpipe.cli", "caption", folder, "--model", ckpt, "--format", "jsonl",
                   "--output", output, "--errors-file", errors, "--max-new-tokens", str(args.new_tokens),
                   "--min-new-tokens", str(args.new_tokens), *args.caption_args.split()]
        # Exit code 1: some captions came back empty (random weights); caption_rows refuses any
        # other error, and every image must be accounted for.
        wall, cpu, _, err = run_child(command, env, cwd, ok=(0, 1))
        written, empty = caption_rows(output, errors)
        if written + empty != count:
            raise RuntimeError(f"mmpipe caption: {written} captions + {empty} empty for {count} files:\n"
                               f"{err[-2000:]}")
        summary = [line for line in err.splitlines() if line.startswith("captioned ")]
        result["caption"].append({"files": count, "wall_s": wall, "cpu_s": cpu, "files_per_s": count / wall,
                                  "cpu_s_per_image": cpu / count, "captions": written, "empty": empty,
                                  "summary": summary[-1] if summary else "", "args": args.caption_args})
        rows.append([count, round(wall, 1), round(count / wall, 1), round(cpu / count, 3), written, empty,
                     summary[-1] if summary else ""])
    if rows:
        print(table(f"`mmpipe caption DIR --format jsonl` (second process, {args.new_tokens} new tokens, "
                    f"{args.caption_args or 'default settings'})", ["files", "wall s", "files / wall s",
                                                                   "CPU s per image", "captions", "empty captions",
                                                                   "the tool's own summary"], rows))
    return result
