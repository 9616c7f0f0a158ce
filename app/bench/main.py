"""Side-by-side benchmarks, run on a GPU. Every figure is a median of timed repeats after warm-up,
and every comparison is measured in the same process.

    python -m mmpipe.app.bench kernels       # attention kernels: decode bandwidth, extend variants, ViT varlen
    python -m mmpipe.app.bench throughput    # 256 captioning requests: engine vs transformers
    python -m mmpipe.app.bench vit           # ViT per-image latency (transformers / eager / graph), graph memory
    python -m mmpipe.app.bench decode        # LM decode: transformers (2 caches) vs mmpipe eager vs graphs
    mmpipe bench kernels              # the same through the CLI

Models are Qwen2.5-VL-3B-shaped with random weights (built here, never downloaded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from mmpipe.app.bench.shapes import QWEN25_VL_3B_TEXT, QWEN25_VL_3B_VISION, SHAPES, add_shape_argument  # noqa: F401


def median_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- kernels

def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s): the memory ceiling."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def paged_cache(batch: int, ctx: int, page_size: int, kv_heads: int, dim: int, dtype: torch.dtype):
    pages_per_seq = math.ceil(ctx / page_size)
    num_pages = batch * pages_per_seq + 1
    k = torch.randn(num_pages, page_size, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    table = (torch.randperm(num_pages - 1, device="cuda")[: batch * pages_per_seq] + 1).view(batch, -1).int()
    return k, v, table


def bench_decode(copy_gbs: float, shapes: tuple[int, int, int] = (16, 2, 128)) -> list[list[Any]]:
    from mmpipe.kernels.decode_attention import decode_num_splits, paged_decode

    heads, kv_heads, dim = shapes
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in (1, 32, 128):
        # The split count a decode graph for this batch bucket uses, whatever the lengths.
        splits = decode_num_splits(batch, kv_heads, num_sms)
        for ctx in (512, 4096, 32768):
            k, v, table = paged_cache(batch, ctx, 16, kv_heads, dim, torch.bfloat16)
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            ms = median_ms(lambda: paged_decode(q, k, v, table, lens, out, dim**-0.5, splits))
            kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
            gbs = kv_bytes / ms / 1e6
            rows.append([batch, ctx, splits, round(ms * 1000, 1), round(gbs), f"{100 * gbs / copy_gbs:.0f}%"])
            del k, v
            torch.cuda.empty_cache()
    return rows


def bench_extend() -> list[list[Any]]:
    from mmpipe.language.attention.cuda_backend import CudaLMAttention
    from mmpipe.language.attention.metadata import AttentionMetadata
    from mmpipe.language.attention.torch_backend import TorchLMAttention

    heads, kv_heads, dim, page = 16, 2, 128, 16
    cases = [("8 x 1024 new, no cache", [(0, 1024)] * 8), ("1 x 8192 new, no cache", [(0, 8192)]), ("4 x 512 new after 2048", [(2048, 512)] * 4),
             ("16 x 128 new after 1024", [(1024, 128)] * 16), ("1 x 2048 new after 8192", [(8192, 2048)]),
             ("1 x 8192 new after 24576", [(24576, 8192)])]
    rows = []
    for name, seqs in cases:
        lens = [a + b for a, b in seqs]
        batch = len(seqs)
        k_cache, v_cache, table = paged_cache(batch, max(lens), page, kv_heads, dim, torch.bfloat16)
        q_lens = [b for _, b in seqs]
        total = sum(q_lens)
        slots = torch.cat([table[i].long()[torch.arange(a, a + b, device="cuda") // page] * page
                           + torch.arange(a, a + b, device="cuda") % page for i, (a, b) in enumerate(seqs)])
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        meta = AttentionMetadata(False, total, slots, torch.tensor(lens, dtype=torch.int32, device="cuda"), qsl,
                                 table, lens, q_lens, max(q_lens), max(lens))
        q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        timings = {}
        for label, backend in (("triton (pages)", CudaLMAttention(dim**-0.5, "triton")),
                               ("varlen", CudaLMAttention(dim**-0.5, "varlen")),
                               ("SDPA + mask (reference)", TorchLMAttention(dim**-0.5))):
            timings[label] = median_ms(lambda: backend.forward(q, k, v, meta, out, (k_cache, v_cache)), rep=50)
        flops = sum(4 * b * (a + (b + 1) / 2) * heads * dim for a, b in seqs)
        rows.append([name] + [round(t, 3) for t in timings.values()]
                    + [round(flops / min(timings['triton (pages)'], timings['varlen']) / 1e9, 1)])
        del k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def bench_vit_attention() -> list[list[Any]]:
    import torch.nn.functional as F
    from mmpipe.vision.attention import TorchVisionAttention, VarlenVisionAttention
    from mmpipe.vision.metadata import segments_of

    heads, dim, patches = 16, 80, 1024  # a 448 px image in the 3B ViT
    varlen, flash, batched = VarlenVisionAttention(), VarlenVisionAttention(short_segments=False), TorchVisionAttention()
    rows = []
    for images in (1, 4, 16):
        for kind, lengths in (("full (per image)", [patches] * images), ("window (8x8 patches)", [64] * 16 * images)):
            total = sum(lengths)
            q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            seg = segments_of(lengths, torch.device("cuda"))

            def loop():  # one SDPA call per segment, as transformers' non-flash path does
                start = 0
                for n in lengths:
                    s = slice(start, start + n)
                    F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1))
                    start += n

            t_var = median_ms(lambda: varlen.forward(q, k, v, seg))
            t_flash = median_ms(lambda: flash.forward(q, k, v, seg))
            t_loop = median_ms(loop, rep=50)
            t_batched = median_ms(lambda: batched.forward(q, k, v, seg), rep=50)
            gbs = 4 * q.numel() * q.element_size() / t_var / 1e6  # q, k, v read, out written
            rows.append([images, kind, round(t_var * 1000, 1), round(t_flash * 1000, 1), round(gbs),
                         round(t_loop * 1000, 1), round(t_batched * 1000, 1), f"{t_loop / t_var:.1f}x"])
    return rows


def graph_us_per_call(calls: list[Callable[[], Any]]) -> float:
    """Microseconds per call of `calls` replayed as one CUDA graph (no launch gaps between them,
    as in a captured decode step)."""
    def run() -> None:
        for call in calls:
            call()

    run()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()
        torch.cuda.synchronize()
        graph.capture_begin()
        run()
        graph.capture_end()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 20 / len(calls)


def bench_decode_gemms(copy_gbs: float) -> list[list[Any]]:
    """The 3B decode step's projections through F.linear (cuBLAS) and through mmpipe's few-row
    kernels (`mmpipe.kernels.gemv`, as the model calls them: o and down K-split into partial sums
    at the sizes where it splits), each over 24 distinct weights (as 24 layers: nothing stays in
    L2), inside a CUDA graph: how fast they stream their weights."""
    import torch.nn.functional as F

    from mmpipe.kernels import gemv

    shapes = {"qkv (bias)": (2560, 2048, True, False), "o": (2048, 2048, False, True),
              "gate_up": (22016, 2048, False, False), "down": (2048, 11008, False, True),
              "lm head": (151936, 2048, False, False)}
    rows = []
    for name, (n, k, bias, split) in shapes.items():
        layers = 4 if n > 100000 else 24
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        for m in (1, 8, 32, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_us_per_call([lambda w=w: F.linear(x, w, b) for w in weights])  # noqa: B023
            if split:  # as the model runs them: partial sums, added up by the norm after them
                ours = gemv.linear_split
            elif name == "lm head":  # logits: rounded to bf16, widened to float32 in the kernel
                ours = lambda x, w, b: gemv.linear(x, w, b, out_dtype=torch.float32)  # noqa: E731
            else:
                ours = gemv.linear
            mm_us = graph_us_per_call([lambda w=w: ours(x, w, b) for w in weights]) if m <= gemv.MAX_ROWS else None  # noqa: B023
            best = us if mm_us is None else min(us, mm_us)
            gbs = n * k * 2 / best / 1e3
            rows.append([name, f"{n}x{k}", m, round(us, 2), None if mm_us is None else round(mm_us, 2),
                         "-" if mm_us is None else f"{us / mm_us:.2f}x", round(gbs), f"{100 * gbs / copy_gbs:.0f}%"])
        del weights
        torch.cuda.empty_cache()
    return rows


def _faster(row: list[Any]) -> str:
    return "triton" if row[1] <= row[2] else "varlen"


def run_kernels(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    result = {"device": device, "torch": torch.__version__, "copy_GBps": round(copy_gbs)}
    decode = bench_decode(copy_gbs)
    extend = bench_extend()
    vit = bench_vit_attention()
    gemms = bench_decode_gemms(copy_gbs)
    result.update(decode=decode, extend=extend, vit=vit, gemms=gemms)
    print(f"device {device}, torch {torch.__version__}; device-to-device copy {copy_gbs:.0f} GB/s (read + write)\n")
    print(table("Paged decode (Triton, split-KV), bf16, 16 q heads / 2 kv heads x 128, page 16; eager launches, "
                "so small sizes measure the launch (in-graph step times: `bench decode`)",
                ["batch", "context", "splits", "us", "KV GB/s", "of copy"], decode))
    print(table("Extend attention, bf16, ms (new K/V already in the cache; varlen = FlashAttention on the new "
                "K/V when nothing is cached, else on gathered K/V)",
                ["case", "triton (pages)", "varlen", "SDPA + mask (reference)", "best TFLOP/s"], extend))
    print("faster: " + ", ".join(f"{r[0]}: {_faster(r)}" for r in extend) + "\n")
    print(table("ViT attention, bf16, 16 heads x 80, 1024 patches per image, us",
                ["images", "segments", "mmpipe (varlen; windows: short-segment kernel)", "FlashAttention varlen",
                 "mmpipe GB/s", "per-segment SDPA loop", "batched SDPA (reference)", "loop / mmpipe"], vit))
    print(table("Decode projections, bf16, in a CUDA graph over 24 distinct weights: cuBLAS (F.linear) and "
                "mmpipe's few-row kernels (up to 32 rows; what the model runs: o and down as K-split partial sums, "
                "which the norm after them adds up; the LM head with float32 logits)",
                ["projection", "N x K", "rows", "cuBLAS us", "mmpipe us", "cuBLAS / mmpipe", "weight GB/s (faster)",
                 "of copy"], gemms))
    return result


# ---------------------------------------------------------------------------- throughput

def build_3b_checkpoint(path: str) -> str:
    """A Qwen2.5-VL-3B-shaped checkpoint with random bfloat16 weights."""
    from mmpipe.app.bench.shapes import build_checkpoint

    return build_checkpoint(path, "3b")


def hf_generate_batched(model: Any, path: str, images: list[Any], prompt: str, new_tokens: int,
                        batch_size: int) -> float:
    """Seconds for `transformers` `generate` over `images` (PIL images or file paths) in batches."""
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": prompt}]}],
                                         tokenize=False, add_generation_prompt=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, len(images), batch_size):
        batch = [Image.open(im).convert("RGB") if isinstance(im, str) else im  # files: decoding is timed
                 for im in images[first:first + batch_size]]
        pixels = processor(images=batch, return_tensors="pt")
        counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
        ids = [tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * c), add_special_tokens=False)["input_ids"]
               for c in counts]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])  # left padding
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        inputs = {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": (input_ids == image_token).int(),
                  **pixels}
        model.generate(**{k: v.cuda() for k, v in inputs.items()}, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, top_k=None, top_p=None,
                       temperature=None)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmpipe import Pipeline, SamplingParams
    from mmpipe.pipeline import caption_conversation

    path = build_3b_checkpoint(args.checkpoint or os.path.join(tempfile.gettempdir(), "mmpipe-3b-random"))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)) for _ in range(args.requests)]
    prompt = "Describe this image."
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0.0)
    tokens = args.requests * args.new_tokens
    results: dict[str, float] = {}

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        hf_generate_batched(model, path, images[:4], prompt, 4, 4)  # warm-up
        results[f"transformers generate, batches of {args.hf_batch}"] = hf_generate_batched(
            model, path, images, prompt, args.new_tokens, args.hf_batch)
    del model
    torch.cuda.empty_cache()

    pipe = Pipeline.from_pretrained(path, device="cuda", dtype="bfloat16", num_kv_pages=args.kv_pages,
                                    **json.loads(args.engine or "{}"))
    convs = [caption_conversation(im, prompt) for im in images]
    pipe.chat(convs[:8], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up (Triton JIT, cuBLAS)
    for name, fn in (("mmpipe engine (continuous batching)", lambda: pipe.chat(convs, params, progress=False)),):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        results[name] = time.perf_counter() - start
    base = results[f"transformers generate, batches of {args.hf_batch}"]
    rows = [[name, round(sec, 2), round(args.requests / sec, 1), round(tokens / sec), f"{base / sec:.1f}x"]
            for name, sec in results.items()]
    # Mixed output lengths: where continuous batching matters (static batches wait for their longest).
    mixed = [SamplingParams(max_new_tokens=16 + (i * 37) % 113, ignore_eos=True, temperature=0.0)
             for i in range(args.requests)]
    mixed_tokens = sum(p.max_new_tokens for p in mixed)
    mixed_rows = []
    for name, fn in (("mmpipe engine (continuous batching)", lambda: pipe.chat(convs, mixed, progress=False)),):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        sec = time.perf_counter() - start
        mixed_rows.append([name, round(sec, 2), round(args.requests / sec, 1), round(mixed_tokens / sec)])
    print(f"{args.requests} requests, one 448x448 image each, {args.new_tokens} new tokens (ignore_eos), "
          f"Qwen2.5-VL-3B-shaped random weights, bfloat16, {torch.cuda.get_device_name()}\n")
    print(table("Captioning throughput", ["system", "seconds", "requests/s", "generated tok/s", "vs transformers"],
                rows))
    print(table(f"Mixed lengths: max_new_tokens 16..128 (mean {mixed_tokens / args.requests:.0f}), same requests "
                "otherwise", ["system", "seconds", "requests/s", "generated tok/s"], mixed_rows))
    return {"rows": rows, "mixed_rows": mixed_rows, "device": torch.cuda.get_device_name(),
            "requests": args.requests, "new_tokens": args.new_tokens}


# ---------------------------------------------------------------------------- ViT graphs

_HF_VISION_CLASSES = {"qwen2_5_vl": "models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel",
                      "qwen2_vl": "models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel",
                      "qwen3_vl": "models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel"}


def vision_pair(depth: int | None = None, shape: str = "3b"):
    """transformers' vision tower of `shape` with random weights, and mmpipe's with the same weights."""
    import importlib

    from mmpipe.app.bench.shapes import hf_config
    from mmpipe.vision.attention import make_vision_attention

    from mmpipe.models import spec_for
    from mmpipe.weights import prepare_for_kernels

    spec = SHAPES[shape]
    vision = dict(spec.vision, **({"depth": depth} if depth else {}))
    if depth and "deepstack_visual_indexes" in vision:
        vision["deepstack_visual_indexes"] = [i for i in vision["deepstack_visual_indexes"] if i < depth]
    config = hf_config(shape)
    config = type(config)(**{**config.to_dict(), "vision_config": {**config.vision_config.to_dict(), **vision}})
    module, name = _HF_VISION_CLASSES[spec.family].rsplit(".", 1)
    hf_class = getattr(importlib.import_module(f"transformers.{module}"), name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = hf_class._from_config(config.vision_config).to(torch.bfloat16).eval()
    from mmpipe.app.tiny.synthetic import model_class

    as_json = {**config.to_dict(), "architectures": [model_class(config).__name__]}
    family = spec_for(as_json, shape)
    cfg = family.vision_config(as_json)
    with torch.device("cuda"):
        ours = family.vision_model(cfg).to(torch.bfloat16).eval()
    ours.rotary.init_buffers()
    weights = ours.weight_map()
    loaded, unexpected = weights.load(hf.state_dict().items())
    assert not unexpected and weights.expected_names() <= loaded, (unexpected, weights.expected_names() - loaded)
    prepare_for_kernels(ours)
    ours.attention = make_vision_attention("auto", torch.device("cuda"), torch.bfloat16)
    return hf, ours


def _wall_ms(fn: Callable[[], Any], warmup: int = 3, reps: int = 15) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def _kernel_ms(fn: Callable[[], Any]) -> float:
    """Sum of the GPU kernel times of one call (the floor with no launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.events():
        if getattr(event.device_type, "name", "") == "CUDA":
            total_us += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
    return total_us / 1000


def run_vit(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from mmpipe.vision.graph_runner import ViTGraphRunner, default_buckets
    from mmpipe.vision.metadata import build_pack_meta
    from mmpipe.vision.preprocess import ImageProcessorConfig, preprocess_image
    from PIL import Image


    shape = SHAPES[args.shape]
    hf, ours = vision_pair(shape=args.shape)
    runner = ViTGraphRunner(ours, torch.device("cuda"), default_buckets(16384))
    qwen3 = shape.family == "qwen3_vl"
    image_cfg = ImageProcessorConfig(max_pixels=1344 * 1344, patch_size=ours.cfg.patch_size,
                                     **({"image_mean": (0.5,) * 3, "image_std": (0.5,) * 3} if qwen3 else {}))
    rows = []
    with torch.inference_mode():
        for side in (224, 448, 896, 1344):
            image = Image.fromarray(np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8))
            processed = preprocess_image(image, image_cfg)
            pixels = processed.pixel_values.cuda()
            grid = torch.tensor([processed.grid_thw], device="cuda")
            grids = [processed.grid_thw]

            def hf_run():
                return hf(pixels, grid_thw=grid).pooler_output

            def eager_run():
                return ours(pixels, build_pack_meta(grids, 2, ours.cfg.window_size, ours.cfg.patch_size))

            def graph_run():
                out, graphed = runner.forward(pixels, build_pack_meta(grids, 2, ours.cfg.window_size,
                                                                      ours.cfg.patch_size))
                assert graphed, "the ViT graph did not run"
                return out.clone()

            reference = hf_run()
            agree = max(((x.double() - reference.double()).norm() / reference.double().norm()).item()
                        for x in (main_level(eager_run()), main_level(graph_run())))
            t_hf, t_eager, t_graph = _wall_ms(hf_run), _wall_ms(eager_run), _wall_ms(graph_run)
            floor = _kernel_ms(graph_run) or _kernel_ms(eager_run)  # graph kernels may be invisible
            rows.append([f"{side} px", processed.num_patches, round(t_hf, 2), round(t_eager, 2), round(t_graph, 2),
                         round(floor, 2), f"{t_hf / t_graph:.1f}x", f"{t_graph / floor:.2f}x", f"{agree:.1e}"])
        beside = vit_beside_decode(runner, image_cfg) if args.shape == "3b" else []
    stats = runner.stats()
    runner.close()
    print(f"{torch.cuda.get_device_name()}, {shape.label} vision tower (random weights), bfloat16, one image "
          "per call, ms (median of 15)\n")
    print(table("ViT latency per image", ["image", "patches", "transformers eager", "mmpipe eager", "mmpipe graph",
                                          "graph kernel sum", "transformers / graph", "graph / kernel sum",
                                          "max rel diff vs transformers"], rows))
    if beside:
        print(table("A ViT pack (16 x 448 px, graph) beside decode-shaped work (the 3B LM's projections and head at "
                    "batch 256, one graph per step), ms: run one after the other, or the ViT on a second stream",
                    ["decode steps", "ViT alone", "decode alone", "one after the other", "ViT on its own stream",
                     "gain"], beside))
    memory = vit_memory(ours) if not args.quick else {}
    return {"latency": rows, "graph_stats": stats, "memory": memory, "vit_beside_decode": beside}


def main_level(merged: torch.Tensor) -> torch.Tensor:
    """The main merger's rows of a tower's output (Qwen3-VL's also holds the deepstack levels)."""
    return merged[:, 0] if merged.dim() == 3 else merged


def vit_beside_decode(runner: Any, image_cfg: Any, batch: int = 256) -> list[list[Any]]:
    """Whether encoding on a second CUDA stream while the LM decodes would gain anything: both
    are mostly matmuls at this size, so they compete for the same SMs."""
    import numpy as np
    import torch.nn.functional as F
    from mmpipe.vision.metadata import build_pack_meta
    from mmpipe.vision.preprocess import preprocess_image
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [preprocess_image(Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)), image_cfg)
              for _ in range(16)]
    pixels = torch.cat([im.pixel_values for im in images]).cuda()
    vit = runner.vit
    meta = build_pack_meta([im.grid_thw for im in images], 2, vit.cfg.window_size, vit.cfg.patch_size)
    text = QWEN25_VL_3B_TEXT
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    shapes = [(2560, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in shapes]
    head = torch.randn(text["vocab_size"], hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    x, x_inter = (torch.randn(batch, n, device="cuda", dtype=torch.bfloat16) for n in (hidden, inter))

    def step() -> None:
        for _ in range(text["num_hidden_layers"]):
            for w in weights:
                F.linear(x_inter if w.shape[1] == inter else x, w)
        F.linear(x, head)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    encode = lambda: runner.forward(pixels, meta)  # noqa: E731
    rows = []
    for steps in (2, 8):
        def decode() -> None:
            for _ in range(steps):
                graph.replay()

        def together() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                encode()
            decode()
            torch.cuda.current_stream().wait_stream(side)

        t_vit, t_dec = median_ms(encode, warmup=3, rep=20), median_ms(decode, warmup=3, rep=20)
        t_seq = median_ms(lambda: (encode(), decode()), warmup=3, rep=20)
        t_two = median_ms(together, warmup=3, rep=20)
        rows.append([steps, round(t_vit, 2), round(t_dec, 2), round(t_seq, 2), round(t_two, 2), f"{t_seq / t_two:.2f}x"])
    return rows


def vit_memory(vit: Any) -> dict[str, float]:
    """Physical graph memory after capturing 16 buckets in ascending order, per memory mode."""
    from mmpipe.vision.graph_runner import ViTGraphRunner
    from mmpipe.vision.metadata import build_pack_meta

    from mmpipe.graphs.memory import device_memory_in_use as used

    buckets = [256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 12288, 16384]
    results: dict[str, float] = {}
    with torch.inference_mode():
        for label, mode, order in (("arena, largest alone", "arena", buckets[-1:]),
                                   ("arena, 16 ascending", "arena", buckets),
                                   ("one shared pool, 16 ascending", "shared", buckets),
                                   ("pool per graph, largest alone", "per_graph", buckets[-1:]),
                                   ("pool per graph, 16 ascending", "per_graph", buckets)):
            base = used()
            runner = ViTGraphRunner(vit, torch.device("cuda"), buckets, max_graphs=32, memory=mode)
            static = used() - base
            start = time.perf_counter()
            for bucket in order:
                grid = [(1, 2, bucket // 2)]
                meta = build_pack_meta(grid, 2, vit.cfg.window_size, vit.cfg.patch_size)
                # Only the flag is kept: a live view of a graph's output keeps its arena range reserved.
                graphed = runner.forward(torch.randn(bucket, vit.patch_dim, device="cuda"), meta)[1]
                assert graphed, f"the ViT graph for {bucket} patches was not captured"
            seconds = time.perf_counter() - start
            results[label] = (used() - base - static) / 2**20
            results[label + " (capture s)"] = round(seconds, 2)
            runner.close()
            del runner
    alone = results["arena, largest alone"]
    rows = [[k, f"{v:.0f}", f"{v / alone:.2f}x"] for k, v in results.items() if not k.endswith("(capture s)")]
    print(table("ViT graph memory (MiB of GPU memory held by the graphs; 3B vision tower, 16 buckets 256..16384 "
                "patches)", ["memory", "MiB", "vs arena largest alone"], rows))
    return results


def main(argv: list[str] | None = None) -> int:
    from mmpipe.cli import CommandParser  # a usage mistake is one line, as for every subcommand

    parser = CommandParser(prog="mmpipe bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True, parser_class=CommandParser)
    sub.add_parser("kernels", help="attention kernels")
    tp = sub.add_parser("throughput", help="captioning throughput: engine vs transformers")
    tp.add_argument("--requests", type=int, default=256)
    tp.add_argument("--new-tokens", type=int, default=64)
    tp.add_argument("--hf-batch", type=int, default=64)
    tp.add_argument("--kv-pages", type=int, default=8192)
    tp.add_argument("--checkpoint", default=None, help="reuse (or create) the 3B-shaped checkpoint here")
    tp.add_argument("--engine", default=None, help="JSON of EngineConfig overrides")
    vit = sub.add_parser("vit", help="ViT latency: transformers vs mmpipe eager vs graph; graph memory by mode")
    add_shape_argument(vit)
    vit.add_argument("--quick", action="store_true", help="latency only (no graph-memory runs)")
    from mmpipe.app.bench import decode as decode_bench  # (not this module's kernel bench_decode)

    decode_bench.add_arguments(sub.add_parser("decode", help="LM decode speed: transformers (dynamic, static + "
                                              "compile) vs mmpipe (eager, graphs), with the bandwidth floor"))
    from mmpipe.app.bench import prefill as bench_prefill

    bench_prefill.add_arguments(sub.add_parser("prefill", help="time to first token: transformers vs mmpipe "
                                               "eager vs piecewise prefill graphs, with kernel sums"))
    from mmpipe.app.bench import caption as bench_caption

    bench_caption.add_arguments(sub.add_parser("caption", help="captioning files: mmpipe (overlap on/off) vs "
                                               "transformers; timeline PNG; mmpipe caption --gpus N"))
    from mmpipe.app.bench import startup as bench_startup

    bench_startup.add_arguments(sub.add_parser("startup", help="from the command to the result in new processes: "
                                               "from_pretrained to first token (fresh and warm caches), "
                                               "`mmpipe caption` wall clock and CPU seconds"))
    from mmpipe.app.bench import ttft as bench_ttft

    bench_ttft.add_arguments(sub.add_parser("ttft", help="an image request's time to first token from the call, "
                                            "vs its GPU kernel time and its metrics"))
    from mmpipe.app.bench import ray as bench_ray

    bench_ray.add_arguments(sub.add_parser("ray", help="the Ray Data stage vs `mmpipe caption` on the same files: "
                                           "wall, files / wall and the marginal rate"))
    for p in sub.choices.values():
        p.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    result = {"kernels": run_kernels, "throughput": run_throughput, "vit": run_vit,
              "decode": decode_bench.run_decode, "prefill": bench_prefill.run_prefill,
              "caption": bench_caption.run_caption, "startup": bench_startup.run_startup,
              "ttft": bench_ttft.run_ttft, "ray": bench_ray.run_ray}[args.what](args)
    write_json(args.json, result)
    return 0


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(result, handle, indent=2)


