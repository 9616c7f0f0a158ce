"""`mmpipe bench throughput`: captioning requests, one 448x448 image each, through `transformers`
`generate` in static batches and through mmpipe's engine (continuous batching), same process; then
mixed output lengths, where continuous batching matters. Also `hf_generate_batched`, the
`transformers` baseline that `bench caption` uses too."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch
from mmpipe.app.bench.results import table
from mmpipe.app.bench.timing import wall_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--kv-pages", type=int, default=8192)
    parser.add_argument("--checkpoint", default=None, help="reuse (or create) the 3B-shaped checkpoint here")
    parser.add_argument("--engine", default=None, help="JSON of EngineConfig overrides")


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

    def run() -> None:
        for first in range(0, len(images), batch_size):
            batch = [Image.open(im).convert("RGB") if isinstance(im, str) else im  # files: decoding is timed
                     for im in images[first:first + batch_size]]
            pixels = processor(images=batch, return_tensors="pt")
            counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
            ids = [tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * c),
                             add_special_tokens=False)["input_ids"] for c in counts]
            width = max(len(x) for x in ids)
            input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])  # left padding
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            inputs = {"input_ids": input_ids, "attention_mask": mask,
                      "mm_token_type_ids": (input_ids == image_token).int(), **pixels}
            model.generate(**{k: v.cuda() for k, v in inputs.items()}, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, top_k=None, top_p=None,
                           temperature=None)

    return wall_s(run)


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmpipe import Pipeline, SamplingParams
    from mmpipe.captioning import caption_conversation

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
        results[name] = wall_s(fn)
    base = results[f"transformers generate, batches of {args.hf_batch}"]
    rows = [[name, round(sec, 2), round(args.requests / sec, 1), round(tokens / sec), f"{base / sec:.1f}x"]
            for name, sec in results.items()]
    # Mixed output lengths: where continuous batching matters (static batches wait for their longest).
    mixed = [SamplingParams(max_new_tokens=16 + (i * 37) % 113, ignore_eos=True, temperature=0.0)
             for i in range(args.requests)]
    mixed_tokens = sum(p.max_new_tokens for p in mixed)
    mixed_rows = []
    for name, fn in (("mmpipe engine (continuous batching)", lambda: pipe.chat(convs, mixed, progress=False)),):
        sec = wall_s(fn)
        mixed_rows.append([name, round(sec, 2), round(args.requests / sec, 1), round(mixed_tokens / sec)])
    print(f"{args.requests} requests, one 448x448 image each, {args.new_tokens} new tokens (ignore_eos), "
          f"Qwen2.5-VL-3B-shaped random weights, bfloat16, {torch.cuda.get_device_name()}\n")
    print(table("Captioning throughput", ["system", "seconds", "requests/s", "generated tok/s", "vs transformers"],
                rows))
    print(table(f"Mixed lengths: max_new_tokens 16..128 (mean {mixed_tokens / args.requests:.0f}), same requests "
                "otherwise", ["system", "seconds", "requests/s", "generated tok/s"], mixed_rows))
    return {"rows": rows, "mixed_rows": mixed_rows, "device": torch.cuda.get_device_name(),
            "requests": args.requests, "new_tokens": args.new_tokens}
