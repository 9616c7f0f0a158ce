"""`mmpipe serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one Pipeline,
which runs in a process of its own (app/serve_engine.py; app/serve_api.py has the routes,
app/serve_protocol.py the wire format). Needs `pip install 'mmpipe[serve]'`. SIGTERM or Ctrl-C
stops it: running requests are aborted, then the pipeline is closed."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from mmpipe.app.arg_types import (
    EXPERT_PARALLEL_HELP,
    add_prefix_caching_arg,
    count,
    positive,
    prefix_caching_option,
    scale_options,
)

from mmpipe.config import VIT_PARALLEL, VIT_PARALLEL_HELP, GraphMode
from mmpipe.errors import InputError
from mmpipe.quantization import QUANTIZATION_HELP, RUNTIME_QUANTIZATIONS

DESCRIPTION = ("An OpenAI-compatible server: /v1/chat/completions (text, images, videos; streaming), "
               "/v1/completions, /v1/models, /health, /metrics (Prometheus).")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine options a serving command takes: device, dtype, quantization, tensor parallel,
    graph mode, pixel limits, batch size, prefix caching."""
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the best available)")
    group.add_argument("--dtype", default=None, help="bfloat16, float16, float32 (default: by device)")
    group.add_argument("--quantization", default=None, choices=list(RUNTIME_QUANTIZATIONS), help=QUANTIZATION_HELP)
    group.add_argument("--tp", type=positive, default=1,
                       help="tensor parallel: split the language model over this many GPUs")
    group.add_argument("--expert-parallel", action="store_true", help=EXPERT_PARALLEL_HELP)
    group.add_argument("--vit-parallel", default=None, choices=list(VIT_PARALLEL), help=VIT_PARALLEL_HELP)
    group.add_argument("--graph-mode", default=None, choices=[m.value for m in GraphMode],
                       help="language-model CUDA graphs (default: full_and_piecewise on CUDA)")
    group.add_argument("--min-pixels", type=positive, default=None,
                       help="smallest image area in pixels (default: the checkpoint's)")
    group.add_argument("--max-pixels", type=positive, default=None,
                       help="largest image area in pixels (default: the checkpoint's); fewer image tokens")
    group.add_argument("--batch-size", type=positive, default=None,
                       help="most requests decoding together (default: the engine's 256)")
    add_prefix_caching_arg(group)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Pipeline.from_pretrained`'s keyword arguments from `add_engine_args`' flags."""
    if args.min_pixels is not None and args.max_pixels is not None and args.min_pixels > args.max_pixels:
        raise InputError(f"--min-pixels ({args.min_pixels}) must not be above --max-pixels ({args.max_pixels})")
    return {"device": args.device, "dtype": args.dtype, "graph_mode": args.graph_mode,
            "min_pixels": args.min_pixels, "max_pixels": args.max_pixels, **scale_options(args),
            **prefix_caching_option(args)}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from mmpipe.cli import CommandParser

    parser = parser or CommandParser(prog="mmpipe serve", description=DESCRIPTION)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=count, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="clients must send 'Authorization: Bearer KEY' (default: no key)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in requests and /v1/models (default: the checkpoint folder's name)")
    parser.add_argument("--allowed-local-media-path", default=None,
                        help="image_url / video_url may name local files (paths or file:// URIs) under this folder; "
                             "without it only data: URIs are read")
    parser.add_argument("--max-queued", type=count, default=256,
                        help="requests (choices) waiting beyond the batch size before new ones get 503 (default 256)")
    add_engine_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.port > 65535:
        raise InputError(f"--port {args.port} is not a port number")
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        raise InputError(f"--allowed-local-media-path {args.allowed_local_media_path}: not a directory")
    try:
        import uvicorn
        from mmpipe.app.serve_api import create_app
    except ImportError as exc:
        print(f"mmpipe serve: {exc.name} is not installed; run  pip install 'mmpipe[serve]'", file=sys.stderr)
        return 2
    from mmpipe.app.serve_engine import EngineProcess, settle_heap

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    engine = EngineProcess(args.model, **engine_options(args))  # the Pipeline, in a process of its own
    try:
        app = create_app(engine, args.served_model_name, args.api_key or None,
                         args.allowed_local_media_path, args.max_queued)
        # SIGTERM and SIGINT: uvicorn stops accepting, the app's shutdown aborts what still runs.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
        server = _server_class()(config)
        engine_lost = threading.Event()

        def watch() -> None:  # the engine's process ending under a running server stops the server
            engine.wait()
            if not server.should_exit:
                engine_lost.set()
                server.should_exit = True

        threading.Thread(target=watch, name="mmpipe-engine-watch", daemon=True).start()
        settle_heap()  # the event loop's pauses too
        server.run()
    finally:
        engine.close()
        logging.getLogger("mmpipe.serve").info("mmpipe serve: pipeline closed")
    if engine_lost.is_set():
        print(f"mmpipe serve: {engine.failure or 'the engine process ended'}; the server stopped", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def on_loopback(app: Any, start_timeout_s: float = 60.0) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port, on a thread of this process (no access log);
    yields its base URL (http://127.0.0.1:PORT). For benchmarks and tests."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="mmpipe-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM or SIGINT it shut down for is not raised again
        afterwards (uvicorn re-raises it, which would kill the process before the pipeline closes)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C
            self.should_exit = True

    return Server


def main(argv: Sequence[str] | None = None) -> int:
    from mmpipe.cli import guarded

    args = build_parser().parse_args(argv)
    return guarded("mmpipe serve", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
