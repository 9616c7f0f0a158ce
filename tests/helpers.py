"""Test helpers: tiny checkpoints, random images, and the transformers oracle."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mmpipe.app.tiny.synthetic import (
    FAMILY_CONFIGS,
    build_tokenizer,
    model_class,
    random_model,
    write_checkpoint,
)
from PIL import Image

CORPUS = ["Tell me a story about a fox.", "Describe this image.", "compare the two pictures",
          "héllo wörld ✓ 🙂 日本語", "a small green triangle at the bottom"]


def make_tokenizer():
    return build_tokenizer(CORPUS, vocab_size=400)


def make_checkpoint(path: str, *, tie: bool = False, layout: str | None = None, seed: int = 0,
                    vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None,
                    logit_scale: float = 8.0, family: str = "qwen2_5_vl", **write_kwargs: Any) -> str:
    """A tiny random checkpoint of a family (default Qwen2.5-VL). `logit_scale` sharpens the head
    so greedy decoding has clear winners (a random head gives near-ties that any rounding could
    flip). `layout` None: as transformers writes the family."""
    tokenizer = make_tokenizer()
    config = FAMILY_CONFIGS[family](tokenizer, vision=vision, text=text, tie_word_embeddings=tie)
    model = random_model(config, seed=seed, logit_scale=1.0 if tie else logit_scale)
    if tie:  # the head is the embedding: sharpen both
        with torch.no_grad():
            model.model.language_model.embed_tokens.weight.mul_(logit_scale ** 0.5 * 4)
    return write_checkpoint(path, model, tokenizer, layout=layout, **write_kwargs)


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth random image (noise plus gradients) so resizing has real work to do."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8).astype(np.float32)
    yy, xx = np.mgrid[0:height, 0:width]
    base[..., 0] = 0.5 * base[..., 0] + 127 * (xx / max(1, width - 1))
    base[..., 1] = 0.5 * base[..., 1] + 127 * (yy / max(1, height - 1))
    image = Image.fromarray(base.clip(0, 255).astype(np.uint8), "RGB")
    return image if mode == "RGB" else image.convert(mode)


def png_bytes(image: Image.Image, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **kwargs)
    return buf.getvalue()


def hf_model(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """transformers' model of the checkpoint's family, the numerical oracle."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return model_class(config).from_pretrained(path, dtype=dtype).to(device).eval()


def hf_inputs(path: str, conversation: Sequence[dict[str, Any]], device: str = "cpu",
              videos: Sequence[Any] = ()) -> dict[str, torch.Tensor]:
    """What transformers' Qwen-VL processors produce: the chat template rendered, each
    <|image_pad|> repeated once per merged patch, then tokenised; pixels from the PIL processor.
    A video part's frames are `videos` (mmpipe's `PreprocessedVideo`s, in order: the frames it
    sampled and resized, patches by the host arithmetic); its placeholder is expanded as the
    family's transformers processor does it (Qwen3-VL: each frame group's time as text), with
    transformers' own timestamp rule and `second_per_grid_ts`."""
    import re

    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    family = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    messages, images = [], []
    for message in conversation:
        content = message["content"]
        if isinstance(content, str):
            messages.append(message)
            continue
        parts = []
        for part in content:
            if part["type"] == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            elif part["type"] in ("video", "video_url"):
                parts.append({"type": "video"})
            else:
                parts.append(part)
        messages.append({"role": message["role"], "content": parts})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out: dict[str, torch.Tensor] = {}
    image_grids = []
    if images:
        processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        pil = [im if isinstance(im, Image.Image) else Image.open(im) for im in images]
        processed = processor(images=pil, return_tensors="pt")
        image_grids = list(processed["image_grid_thw"])
        out["pixel_values"] = processed["pixel_values"]
        out["image_grid_thw"] = processed["image_grid_thw"]
    if videos:
        out["pixel_values_videos"] = torch.cat([g.pixel_values for v in videos for g in v.groups])
        out["video_grid_thw"] = torch.tensor([v.grid_thw for v in videos])
        if family == "qwen2_5_vl":  # the processor's rule: temporal_patch_size / fps, as a float32 tensor
            out["second_per_grid_ts"] = torch.tensor([2 / v.sample_fps for v in videos])
    pieces = re.split(r"(<\|image_pad\|>|<\|video_pad\|>)", text)
    image_it, video_it = iter(image_grids), iter(videos)
    text = ""
    for piece in pieces:
        if piece == "<|image_pad|>":
            text += piece * (int(next(image_it).prod()) // 4)
        elif piece == "<|video_pad|>":
            video = next(video_it)
            t, h, w = video.grid_thw
            if family in ("qwen3_vl", "qwen3_vl_moe"):  # the same processor
                from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

                times = Qwen3VLProcessor._calculate_timestamps(None, list(video.frame_indices), video.video_fps, 2)
                text += "".join(f"<{times[k]:.1f} seconds><|vision_start|>" + piece * (h * w // 4) + "<|vision_end|>"
                                for k in range(t))
            else:
                text += piece * (t * h * w // 4)
        else:
            text += piece
    ids = tokenizer([text], return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video_token = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    types = (ids == image_token).int() + 2 * (ids == video_token).int()
    out.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types)
    return {k: v.to(device) for k, v in out.items()}


@torch.no_grad()
def hf_generate(model, inputs: dict[str, torch.Tensor], max_new_tokens: int
                ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """First-step logits, greedy tokens, and per-step log-probabilities [steps, vocab] from transformers."""
    logits = model(**inputs).logits[0, -1].float()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0, top_k=None, top_p=None, temperature=None,
                         output_logits=True, return_dict_in_generate=True)
    steps = torch.stack([step[0].float() for step in out.logits]).log_softmax(-1)
    return logits, out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), steps


def max_logprob_diff(ours: list[dict[int, float]], reference: torch.Tensor) -> float:
    """Largest |difference| between mmpipe's reported logprobs and the reference's, every step."""
    worst = 0.0
    for step, entries in enumerate(ours):
        for token, value in entries.items():
            worst = max(worst, abs(value - reference[step, token].item()))
    return worst


def first_logits(pipe, conversation: Sequence[dict[str, Any]]) -> torch.Tensor:
    """mmpipe's logits for the token after the prompt (through the engine's own prefill)."""
    from mmpipe import SamplingParams
    from mmpipe.engine.batch import PrefillChunk
    from mmpipe.engine.kv_pages import pages_needed

    request = pipe.processor.build(0, *pipe.processor.render_chat(conversation, "test"),
                                   SamplingParams(max_new_tokens=1), "test")
    request.pages = pipe.runner.pages.allocate(pages_needed(request.prompt_len, pipe.runner.page_size))
    try:
        request.image_embeds = pipe.runner.encode_images(request.images)
        return pipe.runner.prefill([PrefillChunk(request, 0, request.prompt_len)])[0]
    finally:
        pipe.runner.pages.free(request.pages)


def stacked_kv(kv) -> torch.Tensor:
    """A copy of a whole KV cache as [layers, 2, pages, page_size, kv_heads, head_dim]."""
    return torch.stack([torch.stack(pair) for pair in kv.layers])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def cuda_available() -> bool:
    return torch.cuda.is_available() and os.environ.get("MMPIPE_NO_CUDA") != "1"


def run_under_triton_interpreter(script: str) -> Any:
    """Run `script` in a subprocess with TRITON_INTERPRET=1 (read when a kernel is defined, so not
    in this process) and return the JSON it printed after "RESULTS ". The test is skipped if the
    script never printed "READY" (the interpreter cannot run here); after that, failures count."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    if "READY" not in proc.stdout.splitlines():
        pytest.skip(f"the Triton interpreter cannot run here: {proc.stderr.strip().splitlines()[-1:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr
    return json.loads(lines[-1][len("RESULTS "):])


def tower_on_cuda(vit, seed: int = 0, is_norm=lambda name: "norm" in name and "weight" in name):
    """A vision tower ready to run on CUDA in bfloat16: weights random (norm scales, as `is_norm`
    names them, one), rotary tables built, FlashAttention varlen attention."""
    import torch
    from mmpipe.vision.attention import VarlenVisionAttention

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in vit.named_parameters():
            p.copy_(torch.ones_like(p) if is_norm(name) else torch.randn_like(p) * 0.05)
    vit = vit.to(device="cuda", dtype=torch.bfloat16).eval()
    vit.rotary.init_buffers()
    vit.attention = VarlenVisionAttention()
    return vit


def random_pack(vit, grids, seed: int = 0):
    """Random float patches on CUDA for a pack of these grids, and the pack's layout."""
    import torch
    from mmpipe.vision.metadata import build_pack_meta

    meta = build_pack_meta(grids, 2, vit.cfg.window_size, vit.cfg.patch_size)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(meta.num_patches, vit.patch_dim, generator=gen, device="cuda"), meta


class HostKernels:
    """Records the torch kernels that run on host tensors only (views and allocations aside)
    inside the block, and host-device copies whose host operand is not contiguous or not of the
    device operand's dtype (laid out or cast on the host first): those are what may fan out to torch's OpenMP threads, which spin on every core for
    milliseconds afterwards. Host bookkeeping on the hot path should record none. Kernels that an
    op runs inside itself and other threads' ops are not seen."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        calls: list[str] = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, torch.Tensor)]
                name = str(func)
                on_host = [t.device.type == "cpu" for t in tensors]
                if (tensors and all(on_host) and not func.is_view
                        and not any(word in name for word in ("empty", "lift_fresh", "alias", "detach"))):
                    calls.append(name)
                elif any(on_host) and not all(on_host):  # a copy that lays out or casts on the host first
                    host = [t for t in tensors if t.device.type == "cpu"]
                    if (any(not t.is_contiguous() for t in host)
                            or len({t.dtype for t in tensors if t.device.type != "cpu"} | {t.dtype for t in host}) > 1):
                        calls.append(f"{name} (host operand to lay out or cast)")
                return out

        self.calls, self._mode = calls, _Mode()

    def __enter__(self) -> HostKernels:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def replays_equal_eager(forward, static, fresh_inputs) -> None:
    """`forward(static)` captured in a CUDA graph once (compiled outside the capture), then
    replayed with each of `fresh_inputs` copied into `static`: equal to `forward` run eagerly."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(static)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(static)
    for fresh in fresh_inputs:
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, forward(fresh))


def fp8_checkpoint_in_every_graph_mode(quantized: str, reference: str, conversations, held: str) -> None:
    """An FP8 checkpoint on the GPU in float32 (its FP8 layers kept, `held` in its description):
    every graph mode gives eager's greedy tokens, and the first-token logits stay within the
    activation quantization's error of the weights dequantized by hand (`reference`)."""
    from mmpipe import Pipeline, SamplingParams

    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0)
    tokens = {}
    for mode in ("none", "full_decode_only", "piecewise", "full_and_piecewise"):
        pipe = Pipeline.from_pretrained(quantized, device="cuda", dtype="float32", graph_mode=mode,
                                        num_kv_pages=512, max_running_requests=4)
        assert held in pipe.model.quantization, pipe.model.quantization
        tokens[mode] = [o.token_ids for o in pipe.chat(conversations, params)]
        if mode == "none":
            ours = first_logits(pipe, conversations[0])
        pipe.close()
    assert all(t == tokens["none"] for t in tokens.values()), tokens
    by_hand = Pipeline.from_pretrained(reference, device="cuda", dtype="float32", graph_mode="none", num_kv_pages=512)
    assert 1e-5 < rel_err(ours, first_logits(by_hand, conversations[0])) < 0.1
    by_hand.close()
