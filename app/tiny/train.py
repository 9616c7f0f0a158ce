"""Train the bundled model: a small Qwen2.5-VL (transformers' own classes) that captions the
synthetic scenes of `app/tiny/scenes.py`. Meant for a GPU (on a CPU it takes far longer).

    python -m mmpipe.app.tiny.train --out assets/mmpipe-tiny-scenes --steps 6000

Every training batch is freshly generated (scene seeds 0 .. steps*batch-1, never reused), so
there is no fixed training set to overfit. Evaluation uses seeds from 10**9 on, which training
never reaches. The result is saved with `save_pretrained` in the standard layout, with the
tokenizer, chat template, preprocessor and generation configs, and a README recording the run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
from typing import Any, Iterator

import torch
from mmpipe.app.tiny.scenes import COLOURS, COLUMNS, ROWS, SHAPES, SIZES, make_scene, position_phrase, score
from mmpipe.vision.preprocess import ImageProcessorConfig, preprocess_image
from torch.utils.data import DataLoader, IterableDataset

from mmpipe.app.tiny.synthetic import build_tokenizer, qwen2_5_vl_config, write_checkpoint

PROMPT = "Describe this image."
EVAL_SEED_BASE = 10**9
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 16, 392 * 392
VISION = dict(depth=6, hidden_size=192, intermediate_size=576, num_heads=6, fullatt_block_indexes=[2, 5],
              window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})


def caption_corpus() -> list[str]:
    words = [" ".join(["a", s, c, sh]) for s in SIZES for c in COLOURS for sh in SHAPES]
    words += [position_phrase(r, c) for r in range(len(ROWS)) for c in range(len(COLUMNS))]
    return words * 20 + [", and", PROMPT]


def make_tokenizer():
    return build_tokenizer(caption_corpus(), vocab_size=512)


# ---------------------------------------------------------------------------- data

class Encoder:
    """Scene -> (input ids, labels, pixel values, grid), as the chat template lays it out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.image_cfg = ImageProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        self.image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
            tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = ids.index(self.image_id)
        self.before, self.after = ids[:cut], ids[cut + 1:]

    def prompt(self, image) -> tuple[list[int], torch.Tensor, tuple[int, int, int]]:
        processed = preprocess_image(image, self.image_cfg)
        ids = self.before + [self.image_id] * processed.num_tokens + self.after
        return ids, processed.pixel_values, processed.grid_thw

    def example(self, seed: int) -> dict[str, Any]:
        scene = make_scene(seed)
        ids, pixels, grid = self.prompt(scene.image)
        target = self.tokenizer(scene.caption, add_special_tokens=False)["input_ids"] + [self.end_id]
        return {"ids": ids + target, "labels": [-100] * len(ids) + target, "pixels": pixels, "grid": grid}


def collate(examples: list[dict[str, Any]], pad_id: int, image_id: int) -> dict[str, torch.Tensor]:
    length = max(len(e["ids"]) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):  # right padding
        n = len(e["ids"])
        ids[i, :n] = torch.tensor(e["ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "mm_token_type_ids": (ids == image_id).int(),
            "pixel_values": torch.cat([e["pixels"] for e in examples]),
            "image_grid_thw": torch.tensor([e["grid"] for e in examples])}


class SceneBatches(IterableDataset):
    """Batch b holds scenes b*size .. b*size+size-1; workers take every n-th batch."""

    def __init__(self, tokenizer: Any, batch_size: int, first_batch: int, num_batches: int) -> None:
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.first_batch, self.num_batches = first_batch, num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        encoder = Encoder(self.tokenizer)
        pad = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        for b in range(self.first_batch + worker, self.first_batch + self.num_batches, workers):
            seeds = range(b * self.batch_size, (b + 1) * self.batch_size)
            yield collate([encoder.example(s) for s in seeds], pad, encoder.image_id)


# ---------------------------------------------------------------------------- vision attention for training

def register_varlen_attention() -> str:
    """Let transformers' ViT attend within windows with one varlen kernel instead of a Python
    loop over hundreds of windows. Registered under a name containing "flash", which is what
    makes transformers pass cu_seqlens. CUDA: PyTorch's own FlashAttention (varlen_attn); CPU:
    a block-diagonal mask (only for smoke tests)."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                  cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **_: Any):
        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))  # [N, H, D]
        if q.is_cuda:
            from torch.nn.attention.varlen import varlen_attn

            extra = {"scale": scaling} if "scale" in inspect.signature(varlen_attn).parameters else {}
            out = varlen_attn(q, k, v, cu_seq_lens_q.int(), cu_seq_lens_k.int(), int(max_length_q),
                              int(max_length_k), **extra)
        else:
            seg = torch.repeat_interleave(torch.arange(len(cu_seq_lens_q) - 1), torch.diff(cu_seq_lens_q))
            mask = seg[:, None] == seg[None, :]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scaling
            ).transpose(0, 1)
        return out.unsqueeze(0), None

    AttentionInterface.register("mmpipe_flash_varlen", attention)
    return "mmpipe_flash_varlen"


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, tokenizer, seeds: range, device: torch.device, batch_size: int = 50) -> tuple[dict, list]:
    """Greedy captions from transformers' generate on fresh scenes."""
    encoder = Encoder(tokenizer)
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    predictions, references = [], []
    model.eval()
    for start in range(seeds.start, seeds.stop, batch_size):
        scenes = [make_scene(s) for s in range(start, min(start + batch_size, seeds.stop))]
        prompts = [encoder.prompt(s.image) for s in scenes]
        length = max(len(p[0]) for p in prompts)
        ids = torch.full((len(prompts), length), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _, _) in enumerate(prompts):  # left padding for generation
            ids[i, length - len(p):] = torch.tensor(p)
            mask[i, length - len(p):] = 1
        inputs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == encoder.image_id).int(),
                  "pixel_values": torch.cat([p[1] for p in prompts]),
                  "image_grid_thw": torch.tensor([p[2] for p in prompts])}
        inputs = {k: v.to(device) for k, v in inputs.items()}
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False, eos_token_id=encoder.end_id,
                             pad_token_id=pad, top_k=None, top_p=None, temperature=None)
        predictions += tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
        references += [s.caption for s in scenes]
    return score(predictions, references), list(zip(references, predictions))


# ---------------------------------------------------------------------------- training

def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_model(tokenizer: Any, vision: dict | None = None, text: dict | None = None, seed: int = 0):
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = qwen2_5_vl_config(tokenizer, vision=vision or VISION, text=text or TEXT, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def train(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = make_tokenizer()
    vision = dict(VISION, **json.loads(args.vision)) if args.vision else None
    text = dict(TEXT, **json.loads(args.text)) if args.text else None
    if args.resume:  # continue from a saved checkpoint (weights only; the optimiser starts afresh)
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.resume, dtype=torch.float32).to(device)
    else:
        model = build_model(tokenizer, vision, text, args.seed).to(device)
    attn = register_varlen_attention()
    model.model.visual.config._attn_implementation = attn
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters on {device}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    loader = DataLoader(SceneBatches(tokenizer, args.batch_size, args.first_batch, args.steps), batch_size=None,
                        num_workers=args.workers, prefetch_factor=4 if args.workers else None,
                        persistent_workers=False, pin_memory=device.type == "cuda")
    model.train()
    start = time.monotonic()
    history = []
    step = 0
    total = args.steps
    for step, batch in enumerate(loader):
        if args.minutes and step == 200:
            # A time budget: fix the schedule's length from the steady speed of steps 100..199
            # (the data workers are still filling their queues before that).
            per_step = (time.monotonic() - tick) / 100
            total = min(args.steps, int((args.minutes * 60 - (time.monotonic() - start)) / per_step) + step)
            print(f"{per_step * 1000:.0f} ms/step: training {total} steps", flush=True)
        if step == 100:
            tick = time.monotonic()
        if step >= total:
            break
        for group in optim.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(**batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        if step % args.log_every == 0 or step == total - 1:
            elapsed = time.monotonic() - start
            history.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(elapsed, 1)})
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {optim.param_groups[0]['lr']:.2e}  "
                  f"{elapsed:6.1f}s", flush=True)
    train_seconds = time.monotonic() - start
    model.model.visual.config._attn_implementation = "sdpa"
    model.eval()
    return {"model": model, "tokenizer": tokenizer, "device": device, "steps_done": min(step + 1, total),
            "train_seconds": train_seconds, "history": history, "params": params}


def save(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model, tokenizer, device = result["model"], result["tokenizer"], result["device"]
    model = model.to(torch.bfloat16) if args.save_dtype == "bfloat16" else model.float()
    write_checkpoint(args.out, model, tokenizer, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                     generation={"max_new_tokens": 64})
    # Evaluate what was saved (bf16-rounded weights, loaded back in float32).
    saved = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.out, dtype=torch.float32).to(device)
    metrics, samples = evaluate(saved, tokenizer, range(EVAL_SEED_BASE, EVAL_SEED_BASE + args.eval_scenes), device)
    record = {
        "command": "python -m mmpipe.app.tiny.train " + " ".join(args.argv),
        "seed": args.seed, "steps": result["steps_done"], "batch_size": args.batch_size,
        "train_seconds": round(result["train_seconds"], 1), "parameters": result["params"],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "eval_seeds": f"{EVAL_SEED_BASE}..{EVAL_SEED_BASE + args.eval_scenes - 1}",
        "eval": metrics, "loss_history": result["history"], "examples": samples[:8],
    }
    with open(os.path.join(args.out, "training.json"), "w") as handle:
        json.dump(record, handle, indent=2)
    print(json.dumps({k: record[k] for k in ("steps", "train_seconds", "eval")}, indent=2), flush=True)
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--first-batch", type=int, default=0, help="skip this many batches (resuming)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=max(0, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="time budget: after 50 steps, cap --steps to what fits (sets the LR schedule)")
    parser.add_argument("--eval-scenes", type=int, default=200)
    parser.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--resume", default=None, help="start from the weights of a saved checkpoint directory")
    parser.add_argument("--vision", default=None, help="JSON overrides of the vision config")
    parser.add_argument("--text", default=None, help="JSON overrides of the text config")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return save(train(args), args)


if __name__ == "__main__":
    main()
