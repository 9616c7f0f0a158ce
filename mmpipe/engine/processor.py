"""Building requests: chat template, tokenisation, image decoding and preprocessing, placeholder
expansion and M-RoPE positions. Everything here runs on the host, before any forward.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any, Sequence

from language.mrope import mrope_positions
from mmpipe.config import GenerationDefaults, ResolvedSampling, SamplingParams
from mmpipe.engine.detokenizer import IncrementalDetokenizer
from mmpipe.engine.request import Request
from mmpipe.errors import InputError
from mmpipe.inputs import load_image, parse_conversation
from mmpipe.models import LoadedModel
from vision.preprocess import PreprocessedImage, preprocess_image


class InputProcessor:
    def __init__(self, tokenizer: Any, model: LoadedModel, defaults: GenerationDefaults, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.defaults = defaults
        self.max_model_len = max_model_len
        self.image_token_id = model.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(model.image_token_id)
        self.placeholder = f"{model.spec.vision_start_token}{model.spec.image_token}<|vision_end|>"

    def render_chat(self, conversation: Sequence[dict[str, Any]], where: str) -> tuple[str, list[Any]]:
        parsed = parse_conversation(conversation, where)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(f"{where}: the checkpoint has no chat template; use generate() with a formatted prompt")
        try:
            text = self.tokenizer.apply_chat_template(parsed.template_messages, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # jinja raises its own errors (e.g. a role the template rejects)
            raise InputError(f"{where}: the chat template rejected the messages ({exc})") from exc
        return text, parsed.images

    def build(self, index: int, prompt: str, images: Sequence[Any], params: SamplingParams, where: str,
              stream: bool = False) -> Request:
        """One request from a formatted prompt (with one placeholder per image) and its images."""
        sampling = params.resolve(self.defaults)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise InputError(f"{where}: the prompt has {len(slots)} image placeholder(s) "
                             f"({self.image_token}) but {len(images)} image(s) were given")
        processed = [self._image(image, f"{where}, image {i}") for i, image in enumerate(images)]
        expanded: list[int] = []
        starts: list[int] = []
        previous = 0
        for slot, image in zip(slots, processed):
            expanded += ids[previous:slot]
            starts.append(len(expanded))
            expanded += [self.image_token_id] * image.num_tokens
            previous = slot + 1
        expanded += ids[previous:]
        if not expanded:
            raise InputError(f"{where}: the prompt is empty")
        need = len(expanded) + sampling.max_new_tokens
        if len(expanded) >= self.max_model_len:
            raise InputError(f"{where}: the prompt has {len(expanded)} tokens; the limit (max_model_len) is "
                             f"{self.max_model_len}, including generated tokens")
        if need > self.max_model_len:
            sampling = _cap_new_tokens(sampling, self.max_model_len - len(expanded))
        positions, delta = mrope_positions(expanded, [im.grid_thw for im in processed], self.image_token_id,
                                           self.model.merge_size)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(32)
        return Request(
            index=index, prompt_ids=expanded, positions=positions, mrope_delta=delta, images=processed,
            image_starts=starts, sampling=sampling, seed=seed,
            detokenizer=IncrementalDetokenizer(self.tokenizer, sampling.stop, sampling.skip_special_tokens),
            incremental_text=bool(sampling.stop) or stream,
        )

    def _image(self, source: Any, where: str) -> PreprocessedImage:
        try:
            return preprocess_image(load_image(source), self.model.image_processor)
        except InputError as exc:
            raise type(exc)(f"{where}: {exc}") from exc


def _cap_new_tokens(sampling: ResolvedSampling, room: int) -> ResolvedSampling:
    """Generation may not run past max_model_len: cap it (vLLM and SGLang do the same)."""
    return replace(sampling, max_new_tokens=room, min_new_tokens=min(sampling.min_new_tokens, room))
