"""Argument types the commands share (a usage mistake is one line naming the value), and the
engine settings their common flags give."""

from __future__ import annotations

import argparse
from typing import Any


def scale_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Pipeline.from_pretrained` settings of the flags `mmpipe caption` and `mmpipe serve` share:
    --quantization, --tp, --expert-parallel, --vit-parallel, --batch-size (those left at their
    defaults are left out)."""
    options: dict[str, Any] = {}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.tp > 1:
        options["tensor_parallel_size"] = args.tp
    if args.expert_parallel:
        options["expert_parallel"] = True
    if args.vit_parallel:
        options["vit_parallel"] = args.vit_parallel
    if args.batch_size:
        options["max_running_requests"] = args.batch_size
    return options


EXPERT_PARALLEL_HELP = ("with --tp: a mixture-of-experts model's experts split whole over the GPUs (E/N each) "
                        "instead of along every expert's width")


def count(value: str) -> int:
    """A whole number, 0 or more."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def positive(value: str) -> int:
    """A whole number, 1 or more."""
    number = count(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def positive_number(value: str) -> float:
    """A finite number above 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return number


def add_prefix_caching_arg(group: Any) -> None:
    """`--prefix-caching` / `--no-prefix-caching`: `EngineConfig.prefix_caching` from the commands
    that serve conversations."""
    group.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV cache of earlier turns and repeated prompts (default: on)")


def prefix_caching_option(args: argparse.Namespace) -> dict[str, Any]:
    return {} if args.prefix_caching is None else {"prefix_caching": args.prefix_caching}
