"""Score a model's greedy captions on fresh synthetic scenes (seeds never used in training).

    python -m mmpipe.app.tiny.eval --scenes 200                  # mmpipe on the bundled model
    python -m mmpipe.app.tiny.eval --scenes 200 --transformers   # also check token identity with transformers
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from mmpipe.app.tiny.scenes import make_scene, score

TEST_SEED_BASE = 2_000_000_000  # training uses seeds < 10**8, its own evaluation 10**9 ..


def mmpipe_captions(pipe: Any, images: list[Any], max_new_tokens: int = 64) -> list[list[int]]:
    from mmpipe import SamplingParams
    from mmpipe.captioning import caption_conversation

    outputs = pipe.chat([caption_conversation(im) for im in images],
                        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return [o.token_ids for o in outputs]


@torch.no_grad()
def transformers_captions(path: str, images: list[Any], device: str, max_new_tokens: int = 64) -> list[list[int]]:
    """Greedy token ids from transformers' own Qwen2.5-VL, one image at a time (no padding)."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from mmpipe.captioning import DEFAULT_CAPTION_PROMPT

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DEFAULT_CAPTION_PROMPT}]}],
        tokenize=False, add_generation_prompt=True)
    results = []
    for image in images:
        pixels = processor(images=[image], return_tensors="pt")
        count = int(pixels["image_grid_thw"][0].prod()) // processor.merge_size**2
        ids = tokenizer([text.replace("<|image_pad|>", "<|image_pad|>" * count)], return_tensors="pt",
                        add_special_tokens=False)["input_ids"]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "mm_token_type_ids": (ids == image_token).int(), **pixels}
        out = model.generate(**{k: v.to(device) for k, v in inputs.items()}, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=end, pad_token_id=0, top_k=None, top_p=None,
                             temperature=None)
        results.append(out[0, ids.shape[1]:].tolist())
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from mmpipe import Pipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--scenes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=TEST_SEED_BASE, help="first scene seed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--transformers", action="store_true", help="check token identity with transformers")
    args = parser.parse_args(argv)
    scenes = [make_scene(s) for s in range(args.seed, args.seed + args.scenes)]
    pipe = Pipeline.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    start = time.monotonic()
    tokens = mmpipe_captions(pipe, [s.image for s in scenes])
    seconds = time.monotonic() - start
    captions = [pipe.tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
    result: dict[str, Any] = {"model": pipe.model.path, "device": args.device, "seeds": f"{args.seed}.."
                              f"{args.seed + args.scenes - 1}", **score(captions, [s.caption for s in scenes]),
                              "seconds": round(seconds, 2)}
    if args.transformers:
        reference = transformers_captions(pipe.model.path, [s.image for s in scenes], args.device)
        result["token_identical_to_transformers"] = sum(a == b for a, b in zip(tokens, reference)) / len(scenes)
    wrong = [(s.caption, c) for s, c in zip(scenes, captions) if s.caption != c]
    result["wrong_examples"] = wrong[:5]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
