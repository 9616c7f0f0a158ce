"""The Python API: load a checkpoint once, then chat, generate or caption in batches.

    pipe = Pipeline.from_pretrained()                     # the bundled model, best device
    outs = pipe.chat([[{"role": "user", "content": [{"type": "image", "image": "cat.jpg"},
                                                    {"type": "text", "text": "What is this?"}]}]])
    print(outs[0].text)

Inputs are validated and images decoded before any forward runs. With errors="raise" (the
default) the first bad input raises an `InputError` naming it and nothing runs; with
errors="return" bad requests come back with `finish_reason="error"` and the rest complete.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch

from mmpipe.config import EngineConfig, GenerationDefaults, SamplingParams, resolve_device, resolve_dtype
from mmpipe.engine.model_runner import ModelRunner
from mmpipe.engine.processor import InputProcessor
from mmpipe.engine.request import Request, failed_output
from mmpipe.engine.simple_loop import SimpleLoop
from mmpipe.errors import CheckpointError, InputError
from mmpipe.models import LoadedModel, load_model
from mmpipe.outputs import RequestOutput
from mmpipe.weights import read_json

log = logging.getLogger("mmpipe")

DEFAULT_CAPTION_PROMPT = "Describe this image."
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(_REPO_ROOT, "assets", "mmpipe-tiny-scenes")


def default_model_path() -> str:
    """The bundled model (or $MMPIPE_MODEL when set)."""
    path = os.environ.get("MMPIPE_MODEL") or DEFAULT_MODEL_DIR
    if not os.path.isdir(path):
        raise CheckpointError(f"the default model is not at {path!r}; pass a checkpoint directory or set "
                              "MMPIPE_MODEL")
    return path


class Pipeline:
    def __init__(self, model: LoadedModel, tokenizer: Any, engine_config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.engine_config = engine_config
        self.runner = ModelRunner(model, engine_config)
        self.defaults = _generation_defaults(model.path, tokenizer)
        self.processor = InputProcessor(tokenizer, model, self.defaults, self.runner.max_model_len)
        self.loop = SimpleLoop(self.runner)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str] | None = None, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, engine_config: EngineConfig | None = None,
                        **engine_options: Any) -> "Pipeline":
        """Load a local checkpoint directory (None: the bundled model). `engine_options` override
        fields of `engine_config` (e.g. `kv_page_size=32`)."""
        path = os.fspath(path) if path is not None else default_model_path()
        dev = resolve_device(device)
        hf_config = read_json(path, "config.json") if os.path.isdir(path) else {}
        dt = resolve_dtype(dtype, dev, hf_config.get("dtype") or hf_config.get("torch_dtype"))
        config = engine_config or EngineConfig()
        if engine_options:
            try:
                config = config.replace(**engine_options)
            except TypeError as exc:
                raise InputError(f"Pipeline.from_pretrained: {exc}") from None
        model = load_model(path, dev, dt)
        return cls(model, load_tokenizer(path), config)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # ------------------------------------------------------------------ API

    def chat(self, conversations: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             errors: str = "raise") -> list[RequestOutput]:
        """Answer one conversation or a list of them; results in input order."""
        convs = _as_list_of_conversations(conversations)
        params = _per_request(sampling, len(convs))
        built: list[Request | RequestOutput] = []
        for i, conv in enumerate(convs):
            where = f"conversation {i}"
            built.append(self._try(i, errors, lambda: self.processor.build(
                i, *self.processor.render_chat(conv, where), params[i], where)))
        return self._run(built)

    def generate(self, prompts: str | Sequence[str], images: Sequence[Sequence[Any]] | None = None,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 errors: str = "raise") -> list[RequestOutput]:
        """Complete pre-formatted prompts. Each image needs one `<|vision_start|><|image_pad|>
        <|vision_end|>` placeholder in its prompt; `images[i]` lists prompt i's images in order."""
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        if images is not None and len(images) != len(prompt_list):
            raise InputError(f"generate: {len(prompt_list)} prompts but {len(images)} image lists")
        params = _per_request(sampling, len(prompt_list))
        built: list[Request | RequestOutput] = []
        for i, prompt in enumerate(prompt_list):
            if not isinstance(prompt, str):
                raise InputError(f"prompt {i}: must be a string, got {type(prompt).__name__}")
            imgs = list(images[i]) if images is not None else []
            built.append(self._try(i, errors, lambda: self.processor.build(i, prompt, imgs, params[i],
                                                                             f"prompt {i}")))
        return self._run(built)

    def caption(self, images: Sequence[Any] | Any, prompt: str | None = None,
                sampling: SamplingParams | None = None, errors: str = "raise") -> list[str | None]:
        """Caption each image; with errors="return" a failed image gives None."""
        image_list = list(images) if isinstance(images, (list, tuple)) else [images]
        convs = [caption_conversation(image, prompt) for image in image_list]
        outputs = self.chat(convs, sampling, errors=errors)
        return [o.text.strip() if o.ok else None for o in outputs]

    def close(self) -> None:
        """Release the model and KV cache (GPU memory)."""
        for name in ("runner", "model", "loop", "processor"):
            self.__dict__.pop(name, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _try(index: int, errors: str, build: Any) -> Request | RequestOutput:
        if errors not in ("raise", "return"):
            raise InputError(f"errors={errors!r}: use 'raise' or 'return'")
        try:
            return build()
        except InputError as exc:
            if errors == "raise":
                raise
            log.warning("skipping request %d: %s", index, exc)
            return failed_output(index, str(exc))

    def _run(self, built: list[Request | RequestOutput]) -> list[RequestOutput]:
        requests = [b for b in built if isinstance(b, Request)]
        self.loop.run(requests)
        return [b.to_output() if isinstance(b, Request) else b for b in built]


def caption_conversation(image: Any, prompt: str | None = None) -> list[dict[str, Any]]:
    text = prompt or DEFAULT_CAPTION_PROMPT
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise CheckpointError(f"{path}: cannot load the tokenizer ({exc})") from exc


def _generation_defaults(path: str, tokenizer: Any) -> GenerationDefaults:
    cfg = read_json(path, "generation_config.json", required=False) or {}
    extra = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return GenerationDefaults.from_dict(cfg, extra)


def _as_list_of_conversations(conversations: Any) -> list[Any]:
    if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
        return [conversations]  # a single conversation
    if not isinstance(conversations, (list, tuple)):
        raise InputError("chat: pass a conversation (list of messages) or a list of conversations")
    return list(conversations)


def _per_request(sampling: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * count
    if isinstance(sampling, SamplingParams):
        return [sampling] * count
    params = list(sampling)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise InputError(f"sampling: give one SamplingParams or a list of {count}")
    return params
