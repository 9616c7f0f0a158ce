"""The `mmpipe` command.

    mmpipe caption IMAGES...     caption images (files, directories, globs): txt, jsonl, metadata, csv
    mmpipe demo                  the browser chat demo (app/demo.py; needs `pip install mmpipe[app]`)
    mmpipe serve                 an OpenAI-compatible HTTP server (app/serve.py; needs `pip install mmpipe[serve]`)
    mmpipe info [--model PATH]   versions, device, and a summary of a model
    mmpipe bench WHAT            side-by-side GPU benchmarks (app/bench/: kernels, throughput, vit, decode, prefill, caption)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Callable, NoReturn, Sequence


def _info(args: argparse.Namespace) -> int:
    import tokenizers
    import torch
    import transformers

    import mmpipe
    from mmpipe.layers.attention import flash_varlen_available

    info: dict[str, Any] = {
        "mmpipe": mmpipe.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["cuda"] = torch.version.cuda
        info["gpu"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"
        info["gpus"] = torch.cuda.device_count()
    info["varlen_attn"] = flash_varlen_available()  # FlashAttention for the ViT and long LM contexts
    info["model"] = _model_summary(args.model, args.device, args.graph_mode, args.quantization)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for k, v in value.items():
                    print(f"  {k:<{width}} {v}")
            else:
                print(f"{key:<{width}} {value}")
    if "error" in info["model"]:  # versions are printed either way; the exit code says the model failed
        print(f"mmpipe info: {info['model']['error']}", file=sys.stderr)
        return 2
    return 0


def _model_summary(path: str | None, device: str | None, graph_mode: str | None,
                   quantization: str | None = None) -> dict[str, Any]:
    from mmpipe import Pipeline
    from mmpipe.errors import MmpipeError

    try:
        pipe = Pipeline.from_pretrained(path, device=device, graph_mode=graph_mode, quantization=quantization)
    except MmpipeError as exc:
        return {"error": str(exc)}
    model, stats = pipe.model, pipe.stats()
    vit, text = model.vision.cfg, model.language.cfg
    count = lambda m: sum(t.numel() for t in (*m.parameters(), *m.buffers()))  # noqa: E731 (FP8 weights are buffers)
    return {
        "path": model.path,
        "family": model.spec.family,
        "architecture": model.spec.architecture,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantization": model.quantization or "none",
        "vision": f"{vit.depth} blocks x {vit.hidden_size} ({vit.num_heads} heads), patch {vit.patch_size}, "
                  f"{_attention_summary(vit)}, {count(model.vision) / 1e6:.2f}M params",
        "language": f"{text.num_layers} layers x {text.hidden_size} ({text.num_heads} heads, "
                    f"{text.num_kv_heads} kv), vocab {text.vocab_size}, "
                    f"{'tied' if text.tie_word_embeddings else 'untied'} head, "
                    f"{count(model.language) / 1e6:.2f}M params",
        "kv_cache": f"{pipe.runner.pages.capacity} pages x {pipe.runner.page_size} tokens",
        "max_model_len": pipe.runner.max_model_len,
        "graphs": _graph_summary(stats),
        "scheduling": _scheduling_summary(stats),
        "startup": pipe.startup_report(),
    }


def _attention_summary(vit: Any) -> str:
    """Windows and full-attention blocks (Qwen2.5-VL), or full attention everywhere, plus deepstack."""
    if vit.window_size is not None:
        text = f"window {vit.window_size}px, full attention at {list(vit.fullatt_block_indexes)}"
    else:
        text = "full attention in every block"
    deepstack = list(getattr(vit, "deepstack_visual_indexes", ()))
    return text + (f", deepstack after blocks {deepstack}" if deepstack else "")


def _scheduling_summary(stats: dict[str, Any]) -> str:
    """One line: whether steps overlap the host's work, whether the ViT has its own stream, and
    whether prompts reuse cached KV pages."""
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    return (f"overlapped scheduling {on(stats['overlap_schedule'])}, vision stream {on(stats['vision_stream'])}, "
            f"prefix caching {on(stats['prefix_cache']['enabled'])}")


def _graph_summary(stats: dict[str, Any]) -> str:
    """One line: the LM graph mode, and graphs / captures / capture seconds / MiB per runner."""
    parts = [f"mode {stats['graph_mode']}"]
    for name in ("decode", "prefill", "vit"):
        part = stats[name]
        if not part.get("enabled"):
            parts.append(f"{name} off")
            continue
        parts.append(f"{name} {part['graphs']} graphs ({part['captures']} captured in {part['capture_seconds']:.1f} s, "
                     f"{part['memory_bytes'] / 2**20:.0f} MiB, {part['replays']} replays, "
                     f"{part['eager_fallbacks']} eager fallbacks)")
    return "; ".join(parts)


class CommandParser(argparse.ArgumentParser):
    """A usage mistake is one line (and a pointer to -h), not the whole usage text."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} -h)\n")


def guarded(prog: str, command: Callable[[], int]) -> int:
    """Run a subcommand so that no expected failure ends in a traceback: mmpipe's own errors
    (bad model, device, dtype, input) and a closed stdout (`| head`) give one line and a
    non-zero exit code."""
    from mmpipe.errors import MmpipeError

    try:
        return command()
    except MmpipeError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Whoever read our output stopped reading; keep the interpreter from failing again at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        print(f"{prog}: output closed early (broken pipe)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def exit_now(code: int) -> None:
    """End the process at once with `code`, its output flushed: interpreter teardown (torch, CUDA,
    threads) takes most of a second, and a run killed then could not tell, when started again,
    that it had finished."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)


def console_main() -> int:
    """The `mmpipe` command (a console script): `main`, ending a caption run at once."""
    return main(exit_at_once=True)


def build_parser() -> CommandParser:
    """`mmpipe`'s parser: caption, demo, serve and info (`bench` parses its own arguments)."""
    from mmpipe.app import caption, demo, serve
    from mmpipe.config import GraphMode

    parser = CommandParser(prog="mmpipe", description="Fast vision-language model inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    caption.build_parser(sub.add_parser("caption", help="caption images"))
    demo.build_parser(sub.add_parser("demo", help="the browser chat demo (Gradio)"))
    serve.build_parser(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn)"))
    info = sub.add_parser("info", help="versions, device and a model summary")
    info.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    info.add_argument("--device", default=None)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--graph-mode", default=None, choices=[m.value for m in GraphMode],
                      help="language-model CUDA graphs (default: full_and_piecewise on CUDA)")
    # The choices of mmpipe.quantization.RUNTIME_QUANTIZATIONS, spelled out: this module imports no torch.
    info.add_argument("--quantization", default=None, choices=["fp8", "fp8-all"],
                      help="fp8: the language model's linear layers in FP8; fp8-all: the vision tower's too "
                           "(compute capability 8.9+: Ada, Hopper and later)")
    sub.add_parser("bench", help="GPU benchmarks (see `mmpipe bench -h`)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None, exit_at_once: bool = False) -> int:
    from mmpipe.app import caption, demo, serve

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from mmpipe.app.bench.main import main as bench_main

        return guarded("mmpipe bench", lambda: bench_main(argv[1:]))
    args = parser.parse_args(argv)
    if args.command == "caption":
        code = guarded("mmpipe caption", lambda: caption.run(args))
        if exit_at_once:  # the captions are committed: end now, with no teardown window after it
            exit_now(code)
        return code
    if args.command == "demo":
        return guarded("mmpipe demo", lambda: demo.run(args))
    if args.command == "serve":
        return guarded("mmpipe serve", lambda: serve.run(args))
    return guarded("mmpipe info", lambda: _info(args))


if __name__ == "__main__":
    sys.exit(console_main())
