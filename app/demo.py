"""The browser demo: multimodal chat with streamed answers, a stop button and live statistics.

    mmpipe demo                                   # the bundled model, http://127.0.0.1:7860
    mmpipe demo --model ~/models/Qwen2.5-VL-3B-Instruct --concurrency 8 --port 8000
    python -m mmpipe.app.demo                     # the same (python -m app.demo from a checkout)

Built on Gradio's own chat components (`gr.ChatInterface(multimodal=True)`): several images or
videos per turn (a video plays in the chat and is sampled at Qwen's 2 frames a second unless the
settings say otherwise), multi-turn history whose earlier images and videos stay in the
conversation (the encoder cache makes them cheap to resend), retry / undo / clear, and a stop
button that aborts the request and frees its KV pages. Everyone who opens the page shares one
Pipeline; up to `--concurrency` answers are generated at once and the engine batches them
together. A bad image or video gets an error reply in that chat only. Nothing is fetched from
the network: analytics are off and the fonts are Gradio's bundled ones.

`demo_chat.ChatBackend` holds everything but the page (turning Gradio's history into a
conversation, streaming, the statistics panels of `demo_panels`), so it runs and is tested without
Gradio; `demo_page` is the page and its server; this module is the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

# `from mmpipe.app.demo import ChatBackend, launch` is how a program embeds the demo (docs/demo.md).
from mmpipe.app.arg_types import add_prefix_caching_arg, prefix_caching_option
from mmpipe.app.demo_chat import ChatBackend
from mmpipe.app.demo_page import launch

from mmpipe.config import VIT_PARALLEL, VIT_PARALLEL_HELP, EngineConfig, GraphMode
from mmpipe.errors import MmpipeError
from mmpipe.quantization import QUANTIZATION_HELP, RUNTIME_QUANTIZATIONS


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--concurrency", type=int, default=4, help="answers generated at once (batched together)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the best available)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16, float32 (default: float32 on the CPU, bfloat16 on CUDA, float16 "
                        "for a float16 checkpoint)")
    parser.add_argument("--quantization", default=None, choices=list(RUNTIME_QUANTIZATIONS),
                        help=QUANTIZATION_HELP)
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallel: split the language model over this many GPUs (the device's and the "
                             "next ones)")
    parser.add_argument("--vit-parallel", default=None, choices=list(VIT_PARALLEL), help=VIT_PARALLEL_HELP)
    parser.add_argument("--graph-mode", default=None, choices=[m.value for m in GraphMode],
                        help="language-model CUDA graphs (default: full_and_piecewise on CUDA)")
    parser.add_argument("--min-pixels", type=int, default=None,
                        help="smallest image area in pixels (default: the checkpoint's)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help="largest image area in pixels (default: the checkpoint's); fewer image tokens")
    add_prefix_caching_arg(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        print(f"mmpipe demo: --concurrency must be at least 1, got {args.concurrency}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"mmpipe demo: --port {args.port} is not a port number", file=sys.stderr)
        return 2
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("mmpipe demo: gradio is not installed; run  pip install 'mmpipe[app]'", file=sys.stderr)
        return 2
    from mmpipe import Pipeline

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        # The engine must admit every concurrent answer at once so they are batched together.
        default_running = EngineConfig().max_running_requests
        options = {"max_running_requests": args.concurrency} if args.concurrency > default_running else {}
        if args.quantization:
            options["quantization"] = args.quantization
        if args.tp != 1:  # validated by EngineConfig
            options["tensor_parallel_size"] = args.tp
        if args.vit_parallel:
            options["vit_parallel"] = args.vit_parallel
        pipe = Pipeline.from_pretrained(args.model, device=args.device, dtype=args.dtype, graph_mode=args.graph_mode,
                                        min_pixels=args.min_pixels, max_pixels=args.max_pixels, **options,
                                        **prefix_caching_option(args))
    except MmpipeError as exc:
        print(f"mmpipe demo: {exc}", file=sys.stderr)
        return 2
    try:
        launch(ChatBackend(pipe, concurrency=args.concurrency), args.host, args.port)
    except OSError as exc:  # the port is taken, or the address is not ours
        print(f"mmpipe demo: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        pipe.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from mmpipe.cli import CommandParser

    parser = build_parser(CommandParser(prog="mmpipe demo", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
