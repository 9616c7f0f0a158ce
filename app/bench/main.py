"""Side-by-side benchmarks, run on a GPU. Every figure is a median of timed repeats after warm-up,
and every comparison is measured in the same process.

    python -m mmpipe.app.bench kernels       # attention kernels: decode bandwidth, extend variants, ViT varlen
    python -m mmpipe.app.bench throughput    # 256 captioning requests: engine vs transformers
    python -m mmpipe.app.bench vit           # ViT per-image latency (transformers / eager / graph), graph memory
    python -m mmpipe.app.bench decode        # LM decode: transformers (2 caches) vs mmpipe eager vs graphs
    python -m mmpipe.app.bench serve         # mmpipe serve under load (openai client), vs the Python API
    python -m mmpipe.app.bench structured    # decode ms/step with half the batch held to a JSON schema, vs none
    mmpipe bench kernels              # the same through the CLI

Models are Qwen2.5-VL-3B-shaped with random weights (built here, never downloaded). This module is
the command; each benchmark is a module of its own (`kernels`, `throughput`, `vit`, `decode`,
`prefill`, `caption`, `startup`, `ttft`, `ray`, `video`, `serve`, `prefix`, `structured`, `moe`), their shared timing is `timing`, their
tables and JSON `results`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
from mmpipe.app.bench.results import write_json

# subcommand -> its help; the module mmpipe.app.bench.<subcommand> has `run_<subcommand>(args)`
# and, where it takes options, `add_arguments(parser)`.
BENCHMARKS = {
    "kernels": "attention kernels",
    "throughput": "captioning throughput: engine vs transformers",
    "vit": "ViT latency: transformers vs mmpipe eager vs graph; graph memory by mode",
    "decode": "LM decode speed: transformers (dynamic, static + compile) vs mmpipe (eager, graphs), with "
              "the bandwidth floor",
    "prefill": "time to first token: transformers vs mmpipe eager vs piecewise prefill graphs, with kernel "
               "sums",
    "caption": "captioning files: mmpipe (overlap on/off) vs transformers; timeline PNG; mmpipe caption "
               "--gpus N",
    "startup": "from the command to the result in new processes: from_pretrained to first token (fresh and "
               "warm caches), `mmpipe caption` wall clock and CPU seconds",
    "ttft": "an image request's time to first token from the call, vs its GPU kernel time and its metrics",
    "ray": "the Ray Data stage vs `mmpipe caption` on the same files: wall, files / wall and the marginal "
           "rate",
    "video": "video clips: mmpipe vs transformers (clips/s, CPU s per clip, GPU busy); host memory of one long "
             "video",
    "serve": "mmpipe serve under load (openai client, Poisson arrivals, concurrency caps): TTFT, TPOT, ITL, "
             "throughput; server vs Python API on the same requests",
    "prefix": "prefix caching: time to first token of a conversation's turn 4 and of a repeated request, "
              "cache on vs off; captioning new files on vs off",
    "structured": "structured output's cost: decode ms/step with half the batch constrained by a JSON schema vs "
                  "none, at several batch sizes",
    "moe": "one mixture-of-experts layer: us per call by row count against the expert-read floor; --tune "
           "sweeps the expert kernels' tilings",
}


def build_parser() -> Any:
    """`mmpipe bench`'s parser: one subcommand per benchmark module."""
    from mmpipe.cli import CommandParser  # a usage mistake is one line, as for every subcommand

    parser = CommandParser(prog="mmpipe bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True, parser_class=CommandParser)
    for name, help in BENCHMARKS.items():
        command = sub.add_parser(name, help=help)
        module = importlib.import_module(f"mmpipe.app.bench.{name}")
        if hasattr(module, "add_arguments"):
            module.add_arguments(command)
        command.add_argument("--json", default=None, help="also write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    module = importlib.import_module(f"mmpipe.app.bench.{args.what}")
    result = getattr(module, f"run_{args.what}")(args)
    write_json(args.json, result)
    return 0
