"""Building requests: chat template, tokenisation, image decoding and preprocessing, placeholder
expansion and M-RoPE positions. Everything here runs on the host, before any forward.

Three phases, so that image work can run on worker threads while the engine runs:
`prepare` (template and tokens; caller's thread, since tokenizers are not safe to share across
threads), `load_image` (decode + preprocess; any thread), and `assemble` (expansion, positions,
the Request; caller's thread).
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mmpipe.config import GenerationDefaults, ResolvedSampling, SamplingParams
from mmpipe.engine.batch import ImageInput, VideoInput
from mmpipe.engine.detokenizer import IncrementalDetokenizer
from mmpipe.engine.grammar import Grammars
from mmpipe.engine.preprocessed_cache import PreprocessedCache
from mmpipe.engine.request import Request
from mmpipe.errors import InputError
from mmpipe.inputs import ChatImage, decode_encoded, encoded_bytes, load_image, parse_conversation
from mmpipe.models import LoadedModel
from mmpipe.step_io import VisualRun, temporal_interval
from mmpipe.video_loading import load_video
from mmpipe.video_parts import ChatVideo

# Prompts whose token ids are kept (by text): a captioning job sends one prompt for every image,
# and the tokenizer releases the GIL around its work, so on a busy host each call also waits to get
# it back. Longer prompts are tokenised every time (a chat's turns rarely repeat whole).
PROMPTS_KEPT = 64
PROMPT_CHARS_KEPT = 8192


@dataclass
class Prepared:
    """A request whose text is tokenised and whose images are not yet decoded."""

    index: int
    where: str
    token_ids: list[int]
    image_sources: list[Any]
    sampling: ResolvedSampling
    stream: bool
    submitted: float | None = None  # when the caller submitted it (time.monotonic); None: now


class InputProcessor:
    def __init__(self, tokenizer: Any, model: LoadedModel, defaults: GenerationDefaults, max_model_len: int,
                 max_banned_tokens: int = 16, preprocessed_cache_bytes: int = 0, image_decode: str = "cpu") -> None:
        self.tokenizer = tokenizer
        self.preprocessed = PreprocessedCache(preprocessed_cache_bytes)
        self.max_banned_tokens = max_banned_tokens
        self.image_decode = image_decode
        self.model = model
        self.defaults = defaults
        self.max_model_len = max_model_len
        self.image_token_id = model.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(model.image_token_id)
        self.video_token_id = model.video_token_id
        self.video_token = (None if model.video_token_id is None
                            else tokenizer.convert_ids_to_tokens(model.video_token_id))
        self.vision_start_id, self.vision_end_id = tokenizer.convert_tokens_to_ids(
            [model.spec.vision_start_token, "<|vision_end|>"])
        # Bound to this tokenizer, not to self (no reference cycle keeping the model alive).
        self._tokenize = functools.partial(_tokenize, tokenizer)
        self._kept_ids = functools.lru_cache(maxsize=PROMPTS_KEPT)(self._tokenize)
        self._timestamps: dict[str, tuple[int, ...]] = {}  # Qwen3-VL's "<t seconds>" texts, tokenised
        self.grammars = Grammars(tokenizer, model.language.vocab_size, defaults.eos_token_ids)

    def forget_prompts(self) -> None:
        """Drop the token ids kept for recent prompts (a benchmark run then tokenizes its own)."""
        self._kept_ids.cache_clear()

    def token_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids (a new list: callers may extend it)."""
        return list(self._kept_ids(prompt) if len(prompt) <= PROMPT_CHARS_KEPT else self._tokenize(prompt))

    def render_chat(self, conversation: Sequence[dict[str, Any]], where: str) -> tuple[str, list[ChatImage]]:
        parsed = parse_conversation(conversation, where)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(f"{where}: the checkpoint has no chat template; use generate() with a formatted prompt")
        try:
            text = self.tokenizer.apply_chat_template(parsed.template_messages, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as exc:  # jinja raises its own errors (e.g. a role the template rejects)
            raise InputError(f"{where}: the chat template rejected the messages ({exc})") from exc
        return text, parsed.images

    def prepare(self, index: int, prompt: str, images: Sequence[Any], params: SamplingParams, where: str,
                stream: bool = False, submitted: float | None = None) -> Prepared:
        submitted = time.monotonic() if submitted is None else submitted
        sampling = params.resolve(self.defaults)
        banned = len(set(sampling.stop_token_ids) | set(sampling.eos_token_ids))
        if sampling.min_new_tokens > 0 and banned > self.max_banned_tokens:
            raise InputError(f"{where}: min_new_tokens with {banned} stop and end-of-sequence token ids; at most "
                             f"{self.max_banned_tokens} can be held back (EngineConfig.max_banned_tokens)")
        if sampling.json_schema is not None:
            self.grammars.grammar(sampling.json_schema, where)  # a schema it cannot compile fails here, named
        ids = self.token_ids(prompt)
        self._check_placeholders(ids, ["video" if isinstance(src, ChatVideo) else "image" for src in images], where)
        if not ids:
            raise InputError(f"{where}: the prompt is empty")
        return Prepared(index, where, ids, list(images), sampling, stream, submitted)

    def _check_placeholders(self, ids: Sequence[int], wanted: list[str], where: str) -> None:
        """The prompt's image and video placeholders, in order, are `wanted` ("image"/"video")."""
        if "video" in wanted and self.video_token_id is None:
            raise InputError(f"{where}: this checkpoint takes no video (its config.json has no video_token_id)")
        found = [("image" if t == self.image_token_id else "video") for t in ids
                 if t == self.image_token_id or t == self.video_token_id]
        if found != wanted:
            counts = [f"{found.count(kind)} {kind} placeholder(s) ({token})"
                      for kind, token in (("image", self.image_token), ("video", self.video_token))
                      if token is not None and (kind in found or kind in wanted)]
            given = f"{wanted.count('image')} image(s) and {wanted.count('video')} video(s)"
            order = " in another order" if sorted(found) == sorted(wanted) else ""
            raise InputError(f"{where}: the prompt has {' and '.join(counts) or 'no placeholders'} but {given} "
                             f"were given{order}")

    def load_image(self, source: Any, where: str) -> ImageInput | VideoInput:
        """Decode and preprocess one image or video (thread-safe). `source` is anything
        `mmpipe.inputs.load_image` reads, a `ChatImage` from a conversation, whose size keys
        (min_pixels, ...) adjust the model's preprocessing config for this image
        (`ImageProcessorConfig.with_size`), or a `ChatVideo` (`mmpipe.video_loading`)."""
        if isinstance(source, ChatVideo):
            try:
                return load_video(source, self.model.image_processor, self.model.spec.preprocess_video,
                                  decode=self.image_decode)
            except InputError as exc:
                raise type(exc)(f"{where}: {exc}") from exc
        size = None
        if isinstance(source, ChatImage):
            source, size = source.source, source.size
        try:
            config = self.model.image_processor
            if size is not None:
                config = config.with_size(size)
            data = encoded_bytes(source)
            if data is None:  # a PIL image or an array: decoded already
                return self.model.spec.preprocess(load_image(source), config)
            if self.image_decode == "gpu":  # a JPEG: only its header read here, the GPU decodes it
                deferred = self.model.spec.defer_jpeg(data, source, config)
                if deferred is not None:
                    return deferred
            if not self.preprocessed.capacity:  # cache off: no hashing either
                return self.model.spec.preprocess(decode_encoded(data, source), config)
            key = self.preprocessed.key(data, config)
            cached = self.preprocessed.get(key)
            if cached is not None:  # the same file again (a chat's later turns, a repeated image)
                return cached
            image = self.model.spec.preprocess(decode_encoded(data, source), config)
            self.preprocessed.put(key, image)
            return image
        except InputError as exc:
            raise type(exc)(f"{where}: {exc}") from exc

    def image_where(self, prepared: Prepared, k: int) -> str:
        """How errors name source k: the image or video it is, counted within its kind."""
        kind = "video" if isinstance(prepared.image_sources[k], ChatVideo) else "image"
        same = sum(1 for src in prepared.image_sources[:k] if isinstance(src, ChatVideo) == (kind == "video"))
        return f"{prepared.where}, {kind} {same}"

    def assemble(self, prepared: Prepared, images: Sequence[ImageInput | VideoInput]) -> Request:
        ids = prepared.token_ids if isinstance(prepared.token_ids, list) else list(prepared.token_ids)
        self._check_placeholders(ids, ["video" if isinstance(x, VideoInput) else "image" for x in images],
                                 prepared.where)
        expanded: list[int] = []
        starts: list[int] = []
        items: list[ImageInput] = []  # what the tower encodes: images, and each video's frame groups
        runs: list[VisualRun] = []
        visuals = iter(images)
        for token in ids:
            if token == self.image_token_id:
                image = next(visuals)
                starts.append(len(expanded))
                items.append(image)
                runs.append(VisualRun(len(expanded), image.grid_thw))
                expanded += [token] * image.num_tokens
            elif token == self.video_token_id:
                self._expand_video(next(visuals), token, expanded, starts, items, runs)
            else:
                expanded.append(token)
        sampling = prepared.sampling
        if len(expanded) >= self.max_model_len:
            raise InputError(f"{prepared.where}: the prompt has {len(expanded)} tokens; the limit (max_model_len) "
                             f"is {self.max_model_len}, including generated tokens")
        if len(expanded) + sampling.max_new_tokens > self.max_model_len:
            sampling = _cap_new_tokens(sampling, self.max_model_len - len(expanded))
        positions, delta = self.model.spec.positions(len(expanded), runs, self.model.merge_size)
        images = items
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(32)
        return Request(
            index=prepared.index, prompt_ids=expanded, positions=positions, mrope_delta=delta, images=images,
            image_starts=starts, sampling=sampling, seed=seed,
            detokenizer=IncrementalDetokenizer(self.tokenizer, sampling.stop, sampling.skip_special_tokens,
                                               sampling.min_new_tokens),
            incremental_text=bool(sampling.stop) or prepared.stream, where=prepared.where, submitted=prepared.submitted,
            grammar=(None if sampling.json_schema is None
                     else self.grammars.matcher(sampling.json_schema, prepared.where)),
        )

    def _expand_video(self, video: VideoInput, token: int, expanded: list[int], starts: list[int],
                      items: list[ImageInput], runs: list[VisualRun]) -> None:
        """A video's placeholder becomes its frame groups' tokens, as transformers' processor of
        the family writes them: one run (Qwen2-VL, Qwen2.5-VL), or per group its time as text
        and the group between vision start and end tokens (Qwen3-VL)."""
        timed = self.model.spec.video_time
        if timed == "timestamps":
            for group, seconds in zip(video.groups, video.timestamps):
                expanded += self._timestamp_ids(seconds)
                expanded.append(self.vision_start_id)
                starts.append(len(expanded))
                items.append(group)
                runs.append(VisualRun(len(expanded), group.grid_thw))
                expanded += [token] * group.num_tokens
                expanded.append(self.vision_end_id)
            return
        interval = 1.0 if timed == "index" else temporal_interval(self.model.tokens_per_second, video.seconds_per_group)
        runs.append(VisualRun(len(expanded), video.grid_thw, interval))
        for group in video.groups:
            starts.append(len(expanded))
            items.append(group)
            expanded += [token] * group.num_tokens

    def _timestamp_ids(self, seconds: float) -> tuple[int, ...]:
        text = f"<{seconds:.1f} seconds>"
        ids = self._timestamps.get(text)
        if ids is None:
            ids = self._timestamps[text] = self._tokenize(text)
        return ids

    def build(self, index: int, prompt: str, images: Sequence[Any], params: SamplingParams, where: str,
              stream: bool = False) -> Request:
        """All three phases in the caller's thread."""
        prepared = self.prepare(index, prompt, images, params, where, stream)
        loaded = [self.load_image(src, self.image_where(prepared, k)) for k, src in enumerate(images)]
        return self.assemble(prepared, loaded)


def _tokenize(tokenizer: Any, prompt: str) -> tuple[int, ...]:
    return tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _cap_new_tokens(sampling: ResolvedSampling, room: int) -> ResolvedSampling:
    """Generation may not run past max_model_len: cap it (vLLM and SGLang do the same)."""
    return replace(sampling, max_new_tokens=room, min_new_tokens=min(sampling.min_new_tokens, room))
