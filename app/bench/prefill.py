"""`mmpipe bench prefill`: time to first token (3B shape, or `--shape`), one process, side by side.

Rows: text prompts of 64, 256, 1024 and 4096 random ordinary tokens, and one 448x448 image + 32
text tokens. Systems: `transformers` (`generate(max_new_tokens=1)`, default cache), mmpipe with
the prefill eager (graph mode `full`) and mmpipe piecewise (`full_and_piecewise`). TTFT is the
median wall time from handing the request to the engine to its first token (host work
included: building the step, sampling, reading the token back). Next to each mmpipe row: the sum
of its GPU kernel times over one such request (profiler, run after all timings: a profiler session
leaves per-launch overhead behind), the floor without launch gaps or host work. The image row runs with the encoder cache off, so every request encodes its image (through
the ViT graphs). Also: capture seconds and graph memory of the whole prefill schedule and of its
largest size alone, and start-up time with a cold and a warm compile cache for both piece
compilers.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
from typing import Any, Callable

import torch
from mmpipe.app.bench.decode_systems import make_prompts
from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import SHAPES, add_shape_argument, build_checkpoint
from mmpipe.app.bench.timing import kernel_ms, timed, wall_ms

LENGTHS = (64, 256, 1024, 4096)
IMAGE_ROW = "image+32"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_argument(parser)
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the random checkpoint here")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="text prompt lengths")
    parser.add_argument("--repeats", type=int, default=20, help="timed requests per row (median)")
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--skip-startup", action="store_true", help="leave out the start-up and memory runs")
    parser.add_argument("--compilers", default="eager,inductor", help="piece compilers of the start-up runs")
    parser.add_argument("--quantization", choices=("fp8",), default=None, help="mmpipe's language model in FP8")


def image_448() -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))


# ---------------------------------------------------------------------------- mmpipe

class MmpipeTTFT:
    def __init__(self, path: str, mode: str, **options: Any) -> None:
        from mmpipe.app.bench.shapes import load_options

        from mmpipe import Pipeline

        # A fixed KV cache (65k tokens) so the two mmpipe systems fit side by side.
        options.setdefault("num_kv_pages", 4096)
        options.update(load_options(path))
        self.pipe, self.startup_s = timed(lambda: Pipeline.from_pretrained(
            path, device="cuda", dtype="bfloat16", graph_mode=mode, encoder_cache_bytes=0, prefix_caching=False, max_running_requests=64,
            **options))

    def request_fn(self, token_ids: list[int] | None = None, image: Any = None, text: str = "") -> Callable[[], Any]:
        from mmpipe import SamplingParams
        from mmpipe.engine.processor import Prepared

        pipe = self.pipe
        params = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
        if image is None:
            prepared = Prepared(0, "bench", list(token_ids or []), [], params.resolve(pipe.defaults), False)
            images: list[Any] = []
        else:
            prompt, sources = pipe.processor.render_chat(
                [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}],
                "bench")
            prepared = pipe.processor.prepare(0, prompt, sources, params, "bench")
            images = [pipe.processor.load_image(s, "bench") for s in sources]  # decoded once, outside timing
        engine = pipe.engine

        def run() -> list[int]:
            request = pipe.processor.assemble(prepared, images)
            with engine.lock:
                engine.add(request)
                while not request.finished:
                    engine.step()
            if request.error or len(request.output_ids) != 1:
                raise RuntimeError(f"mmpipe: no first token ({request.error})")
            return request.output_ids

        return run

    def close(self) -> None:
        self.pipe.close()
        self.pipe = None  # type: ignore[assignment]
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- transformers

class HfTTFT:
    def __init__(self, path: str) -> None:
        from mmpipe.app.bench.shapes import hf_model
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.model = hf_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.images = Qwen2VLImageProcessorPil.from_pretrained(path)

    def request_fn(self, token_ids: list[int] | None = None, image: Any = None, text: str = "") -> Callable[[], Any]:
        inputs: dict[str, Any]
        if image is None:
            ids = torch.tensor([token_ids], device="cuda")
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            pixels = self.images(images=[image], return_tensors="pt")
            count = int(pixels["image_grid_thw"].prod(-1)[0]) // 4
            chat = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}], tokenize=False,
                add_generation_prompt=True)
            ids = torch.tensor([self.tokenizer(chat.replace("<|image_pad|>", "<|image_pad|>" * count),
                                               add_special_tokens=False)["input_ids"]], device="cuda")
            image_token = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "mm_token_type_ids": (ids == image_token).int(), **{k: v.cuda() for k, v in pixels.items()}}

        def run() -> Any:
            return self.model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0, top_k=None,
                                       top_p=None, temperature=None)

        return run

    def close(self) -> None:
        self.model = None
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- runs

def text_of_tokens(path: str, n: int) -> str:
    """About `n` tokens of text for the image row's question."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer.decode(make_prompts(path, 1, n, seed=7)[0])


def cases_of(path: str, lengths: list[int]) -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = [(str(n), {"token_ids": make_prompts(path, 1, n, seed=n)[0]})
                                               for n in lengths]
    cases.append((IMAGE_ROW, {"image": image_448(), "text": text_of_tokens(path, 32)}))
    return cases


def measure(system: Any, cases: list[tuple[str, dict[str, Any]]], repeats: int) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for name, kwargs in cases:
        rows[name] = {"ttft_ms": wall_ms(system.request_fn(**kwargs), warmup=3, reps=repeats)}
        print(f"  {name}: {rows[name]}", file=sys.stderr, flush=True)
    return rows


def kernel_sums(system: Any, cases: list[tuple[str, dict[str, Any]]], rows: dict[str, dict[str, Any]]) -> None:
    """Profiled after every timing (a profiler session leaves per-launch overhead behind)."""
    for name, kwargs in cases:
        rows[name]["kernel_ms"] = kernel_ms(system.request_fn(**kwargs))
        print(f"  {name} kernels: {rows[name]['kernel_ms']:.2f} ms", file=sys.stderr, flush=True)


def startup_runs(path: str, compilers: list[str]) -> dict[str, Any]:
    """Capture time and graph memory of the whole schedule vs its largest size alone; start-up with
    a cold and a warm compile cache for both piece compilers."""
    from mmpipe import GraphConfig

    out: dict[str, Any] = {}
    for compiler in compilers:
        cache = tempfile.mkdtemp(prefix="mmpipe-compile-")
        try:
            for phase in ("cold", "warm"):
                try:
                    system = MmpipeTTFT(path, "full_and_piecewise", prefill_compiler=compiler,
                                        compile_cache_dir=cache)
                except Exception as exc:  # report it; the other measurements stand
                    out[f"{compiler}_{phase}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    print(f"  start-up {compiler} {phase} failed: {exc!r}"[:400], file=sys.stderr, flush=True)
                    break
                stats = system.pipe.stats()
                out[f"{compiler}_{phase}"] = {"startup_s": system.startup_s, "prefill": _pick(stats["prefill"]),
                                              "decode_capture_s": stats["decode"].get("capture_seconds")}
                print(f"  start-up {compiler} {phase}: {system.startup_s:.1f} s", file=sys.stderr, flush=True)
                system.close()
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    largest = MmpipeTTFT(path, "piecewise", prefill_graph=GraphConfig(buckets=(8192,)))
    out["largest_alone"] = {"prefill": _pick(largest.pipe.stats()["prefill"])}
    largest.close()
    return out


def _pick(stats: dict[str, Any]) -> dict[str, Any]:
    keys = ("graphs", "capture_seconds", "startup_seconds", "startup_memory_bytes", "sizes")
    detail = ("pieces", "split_points", "graphs_seen", "compilations", "compile_cache_loads", "compile_seconds")
    picked = {k: (len(stats[k]) if k == "sizes" else stats[k]) for k in keys}
    return {**picked, **{k: stats["detail"].get(k) for k in detail}}


def run_prefill(args: argparse.Namespace) -> dict[str, Any]:
    path = build_checkpoint(args.checkpoint, args.shape)
    lengths = [int(x) for x in str(args.lengths).split(",") if x]
    gpu = torch.cuda.get_device_name()
    result: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__, "lengths": lengths, "rows": {},
                              "shape": args.shape, "quantization": args.quantization}
    cases = cases_of(path, lengths)
    if not args.skip_hf:
        print("transformers:", file=sys.stderr, flush=True)
        hf = HfTTFT(path)
        result["rows"]["transformers"] = measure(hf, cases, args.repeats)
        hf.close()
    mmpipe_systems = {}
    for name, mode in (("mmpipe-eager", "full_decode_only"), ("mmpipe-piecewise", "full_and_piecewise")):
        print(f"{name}:", file=sys.stderr, flush=True)
        system = MmpipeTTFT(path, mode, quantization=args.quantization)
        mmpipe_systems[name] = system
        result["rows"][name] = measure(system, cases, args.repeats)
    pw = mmpipe_systems["mmpipe-piecewise"]
    result["piecewise_stats"] = _pick(pw.pipe.stats()["prefill"])
    result["piecewise_startup_s"] = pw.startup_s
    for name, system in mmpipe_systems.items():
        print(f"{name} kernel sums:", file=sys.stderr, flush=True)
        kernel_sums(system, cases, result["rows"][name])
        system.close()
    if not args.skip_startup:
        result["startup"] = startup_runs(path, [c for c in str(args.compilers).split(",") if c])
    print(report(result))
    return result


def report(result: dict[str, Any]) -> str:
    rows = result["rows"]
    names = [str(n) for n in result["lengths"]] + [IMAGE_ROW]
    hf = rows.get("transformers", {})
    eager, pw = rows.get("mmpipe-eager", {}), rows.get("mmpipe-piecewise", {})
    lines = []
    for name in names:
        h, e, p = hf.get(name, {}), eager.get(name, {}), pw.get(name, {})

        def ms(row: dict[str, Any], key: str) -> str:
            return f"{row[key]:.2f}" if key in row else "-"

        ratio = f"{h['ttft_ms'] / p['ttft_ms']:.2f}x" if "ttft_ms" in h and "ttft_ms" in p else "-"
        gap = f"{p['ttft_ms'] / p['kernel_ms']:.2f}" if "kernel_ms" in p else "-"
        lines.append([name, ms(h, "ttft_ms"), ms(e, "ttft_ms"), ms(e, "kernel_ms"), ms(p, "ttft_ms"),
                      ms(p, "kernel_ms"), ratio, gap])
    weights = "bf16" + (f", mmpipe in {result['quantization']}" if result.get("quantization") else "")
    out = table(f"Time to first token, ms ({result['gpu']}, {SHAPES[result.get('shape', '3b')].label} shape, {weights})",
                ["prompt", "transformers", "mmpipe eager", "eager kernels", "mmpipe piecewise", "piecewise kernels",
                 "vs transformers", "TTFT / kernels"], lines)
    start = result.get("startup")
    if start:
        srows = [[k, f"{v['startup_s']:.1f}", f"{v['prefill'].get('capture_seconds', 0):.1f}",
                  f"{(v['prefill'].get('startup_memory_bytes') or 0) / 2**20:.0f}",
                  v["prefill"].get("compilations"), v["prefill"].get("compile_cache_loads")]
                 for k, v in start.items() if "startup_s" in v]
        srows += [[k, "failed", v["error"][:60], "-", "-", "-"] for k, v in start.items() if "error" in v]
        alone = start["largest_alone"]["prefill"]
        srows.append(["largest size alone", "-", f"{alone.get('capture_seconds', 0):.1f}",
                      f"{(alone.get('startup_memory_bytes') or 0) / 2**20:.0f}", "-", "-"])
        out += "\n" + table("Start-up (prefill schedule + decode buckets)",
                            ["run", "start-up s", "prefill capture s", "prefill graph MiB", "compiled", "loaded"], srows)
    return out
