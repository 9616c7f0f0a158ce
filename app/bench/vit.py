"""`mmpipe bench vit`: the vision tower's latency per image (`transformers` eager, mmpipe eager,
mmpipe's ViT graph, and the graph's kernel sum), a ViT pack beside decode-shaped work on a second
stream, and the physical memory of the ViT graphs under each memory mode."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from mmpipe.app.bench.results import table
from mmpipe.app.bench.shapes import QWEN25_VL_3B_TEXT, SHAPES, add_shape_argument
from mmpipe.app.bench.timing import kernel_ms, median_ms, wall_ms

_HF_VISION_CLASSES = {"qwen2_5_vl": "models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel",
                      "qwen2_vl": "models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel",
                      "qwen3_vl": "models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_argument(parser)
    parser.add_argument("--quick", action="store_true", help="latency only (no graph-memory runs)")


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
            t_hf, t_eager, t_graph = wall_ms(hf_run), wall_ms(eager_run), wall_ms(graph_run)
            floor = kernel_ms(graph_run) or kernel_ms(eager_run)  # graph kernels may be invisible
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
