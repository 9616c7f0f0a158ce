"""The systems `mmpipe bench video` compares, one function each, all with one signature:
`run_<system>(checkpoint, clips, warmup, options) -> dict` of plainly named figures, timed from
the first file read to the last token, file decoding included.

- `run_mmpipe`: every clip through one `Pipeline.chat` call (decoding on its preprocess workers,
  continuous batching).
- `run_transformers`: `transformers`' `Qwen2_5_VLProcessor` (its own video processor) and
  `generate` in batches, fed the frames mmpipe samples: the indices and frame size of
  `mmpipe.vision.video_sampling` on the file's `VideoFile` info, decoded by that reader and
  resized by `mmpipe.vision.video_frames.resize_frame`, handed over with `do_resize=False` and
  each clip's `video_metadata` (frame indices and file rate, from which the processor takes the
  sampled rate and `second_per_grid_ts`).

A system that decodes on the GPU adds a function here with the same signature and a line in
`SYSTEMS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from mmpipe.app.bench.gpu_busy import BusySampler
from mmpipe.app.bench.timing import timed


@dataclass
class RunOptions:
    fps: float  # frames sampled per second of video
    new_tokens: int  # generated per clip (end-of-sequence ignored)
    prompt: str
    hf_batch: int = 8
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig overrides
    timeline: str | None = None  # profile one more mmpipe pass and draw it here
    timeline_clips: int = 16
    device: str = "cuda"


def conversation(path: str, fps: float, prompt: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "video", "video": path, "fps": fps},
                                         {"type": "text", "text": prompt}]}]


def _measured(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float, float, BusySampler | None]:
    """`fn()`'s result, wall seconds, the process's CPU seconds (every thread), the GPU busy share."""
    busy = BusySampler(device.index) if device.type == "cuda" else None
    cpu = time.process_time()
    if busy is None:
        result, wall = timed(fn, device)
    else:
        with busy:
            result, wall = timed(fn, device)
    return result, wall, time.process_time() - cpu, busy


def _figures(prefix: str, clips: int, tokens: int, wall: float, cpu: float, busy: BusySampler | None
             ) -> dict[str, Any]:
    return {f"{prefix}_clips": clips, f"{prefix}_seconds": wall, f"{prefix}_clips_per_s": clips / wall,
            f"{prefix}_output_tokens": tokens, f"{prefix}_output_tokens_per_s": tokens / wall,
            f"{prefix}_cpu_s_per_clip": cpu / clips,
            f"{prefix}_gpu_busy": busy.share if busy is not None else None,
            f"{prefix}_gpu_busy_method": busy.describe() if busy is not None else "not a GPU"}


def _checked(outputs: Sequence[Any], new_tokens: int) -> int:
    failed = [o for o in outputs if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} clips failed; the first: {failed[0].error}")
    short = [len(o.token_ids) for o in outputs if len(o.token_ids) != new_tokens]
    if short:
        raise RuntimeError(f"{len(short)} clips generated other than {new_tokens} tokens: {short[:8]}")
    return sum(len(o.token_ids) for o in outputs)


def run_mmpipe(checkpoint: str, clips: Sequence[str], warmup: Sequence[str], options: RunOptions) -> dict[str, Any]:
    from mmpipe import Pipeline, SamplingParams

    params = SamplingParams(max_new_tokens=options.new_tokens, ignore_eos=True, temperature=0.0)
    device = torch.device(options.device)
    convs = [conversation(path, options.fps, options.prompt) for path in clips]
    with Pipeline.from_pretrained(checkpoint, device=options.device, dtype="bfloat16", **options.engine) as pipe:
        _checked(pipe.chat([conversation(p, options.fps, options.prompt) for p in warmup], params,
                           progress=False), options.new_tokens)
        pipe.engine.drain()
        pipe.engine.cache.clear()  # every clip is encoded and prefilled, warm-up or not
        pipe.engine.reset_prefix_cache()
        before = pipe.stats()
        outputs, wall, cpu, busy = _measured(lambda: pipe.chat(convs, params, progress=False), device)
        tokens = _checked(outputs, options.new_tokens)
        after = pipe.stats()
        result = _figures("mmpipe", len(clips), tokens, wall, cpu, busy)
        result["prompt_tokens_per_clip"] = outputs[0].num_prompt_tokens
        result["mmpipe_vit_captures_in_timed_run"] = (after["vit"].get("captures", 0)
                                                      - before["vit"].get("captures", 0))
        result["mmpipe_vit_capture_s_in_timed_run"] = (after["vit"].get("capture_seconds", 0.0)
                                                        - before["vit"].get("capture_seconds", 0.0))
        result["mmpipe_vit_eager_fallbacks_in_timed_run"] = (after["vit"].get("eager_fallbacks", 0)
                                                              - before["vit"].get("eager_fallbacks", 0))
        result["mmpipe_engine"] = {k: after[k] for k in ("graph_mode", "overlap_schedule", "vision_stream")}
        result["mmpipe_encoder_cache"] = after["encoder_cache"]
        if options.timeline:
            result["mmpipe_timeline"] = _profiled(pipe, convs[:options.timeline_clips], params, options)
    return result


def _profiled(pipe: Any, convs: list[Any], params: Any, options: RunOptions) -> dict[str, float]:
    """One more, untimed pass under torch.profiler: GPU busy share and GPU time per phase from
    the trace (`app/bench/timeline.py`), and its PNG."""
    from mmpipe.app.bench.caption import profile_run

    title = (f"mmpipe, {len(convs)} video clips at {options.fps:g} fps, {options.new_tokens} tokens each, "
             f"{torch.cuda.get_device_name()}")
    summary, _ = profile_run(pipe, convs, params, pipe.engine.overlap, options.timeline, title)
    return summary


# ------------------------------------------------------------------------------ transformers


def sampled_frames(path: str, fps: float, factor: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The frames mmpipe feeds its tower for `path` at `fps`, as [frames, 3, h, w] uint8, and the
    `video_metadata` that tells transformers' processor which frames of the file they are."""
    from mmpipe.vision.video_frames import resize_frame
    from mmpipe.vision.video_sampling import VideoOptions, frame_size, sample_frames

    from mmpipe.video_reader import VideoFile

    options = VideoOptions(fps=fps)
    with VideoFile(path) as file:
        info = file.info
        sample = sample_frames(options, info.total_frames, info.fps)
        size = frame_size(info.height, info.width, len(sample.indices), options, factor)
        frames = file.read(sample.indices, lambda frame: resize_frame(frame, size))
    metadata = {"total_num_frames": info.total_frames, "fps": info.fps, "width": info.width,
                "height": info.height, "duration": info.duration, "frames_indices": list(sample.indices)}
    return torch.stack(frames).permute(0, 3, 1, 2).contiguous(), metadata


def hf_processor(checkpoint: str) -> Any:
    """transformers' Qwen2.5-VL processor from the checkpoint's tokenizer and image processor
    config, with a video processor of the same patch sizes and normalisation."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    tokenizer.padding_side = "left"
    images = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    videos = Qwen2VLVideoProcessor(patch_size=images.patch_size, temporal_patch_size=images.temporal_patch_size,
                                   merge_size=images.merge_size, image_mean=images.image_mean,
                                   image_std=images.image_std)
    return Qwen2_5_VLProcessor(images, tokenizer, videos, chat_template=tokenizer.chat_template)


def hf_batch_inputs(processor: Any, paths: Sequence[str], fps: float, prompt: str) -> Any:
    """One batch's model inputs (left-padded), the way Qwen's model cards call the processor
    on frames sampled elsewhere; `second_per_grid_ts` checked against mmpipe's."""
    from mmpipe.vision.video_sampling import seconds_per_group

    factor = processor.video_processor.patch_size * processor.video_processor.merge_size
    frames, metadata = zip(*(sampled_frames(path, fps, factor) for path in paths))
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
        tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text] * len(paths), videos=list(frames), video_metadata=list(metadata),
                       do_resize=False, do_sample_frames=False, padding=True, return_tensors="pt")
    expected = [seconds_per_group(len(m["frames_indices"]) / m["total_num_frames"] * m["fps"]) for m in metadata]
    got = [float(v) for v in inputs["second_per_grid_ts"]]
    if any(abs(a - b) > 1e-5 * b for a, b in zip(got, expected)):
        raise RuntimeError(f"transformers' second_per_grid_ts {got} differ from mmpipe's {expected}: the processor "
                           "did not take the sampled rate from video_metadata")
    return inputs


def hf_generate(model: Any, processor: Any, paths: Sequence[str], options: RunOptions, new_tokens: int) -> int:
    """Tokens generated over `paths` in batches of `options.hf_batch`."""
    tokens = 0
    pad = processor.tokenizer.pad_token_id
    for first in range(0, len(paths), options.hf_batch):
        batch = paths[first:first + options.hf_batch]
        inputs = hf_batch_inputs(processor, batch, options.fps, options.prompt).to(options.device)
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad, top_k=None, top_p=None, temperature=None)
        tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch)
    return tokens


def hf_model(checkpoint: str, device: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def run_transformers(checkpoint: str, clips: Sequence[str], warmup: Sequence[str], options: RunOptions
                     ) -> dict[str, Any]:
    try:
        tokens, wall, cpu, busy = _hf_timed(checkpoint, clips, warmup, options)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the model is gone with `_hf_timed`'s frame
    result = _figures("hf", len(clips), tokens, wall, cpu, busy)
    result["hf_batch"] = options.hf_batch
    return result


def _hf_timed(checkpoint: str, clips: Sequence[str], warmup: Sequence[str], options: RunOptions
              ) -> tuple[int, float, float, BusySampler | None]:
    processor = hf_processor(checkpoint)
    model = hf_model(checkpoint, options.device)
    with torch.inference_mode():
        hf_generate(model, processor, list(warmup), options, min(4, options.new_tokens))
        return _measured(lambda: hf_generate(model, processor, list(clips), options, options.new_tokens),
                         torch.device(options.device))


SYSTEMS: dict[str, Callable[[str, Sequence[str], Sequence[str], RunOptions], dict[str, Any]]] = {
    "mmpipe": run_mmpipe,
    "transformers": run_transformers,
}
