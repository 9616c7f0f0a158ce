"""A checkpoint's tokenizer and generation defaults, loaded without transformers' auto classes where
the checkpoint allows (see `tokenizer_class`)."""

from __future__ import annotations

import os
from typing import Any

from mmpipe.config import GenerationDefaults
from mmpipe.errors import CheckpointError
from mmpipe.weights import read_json

# Tokenizer classes loaded by name, without `AutoTokenizer`: importing the auto classes pulls in
# transformers' model and generation code (and scikit-learn through it), seconds of start-up for a
# tokenizer that is a `tokenizer.json` plus its config. AutoTokenizer resolves these names to the
# same classes and calls the same `from_pretrained`.
DIRECT_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast")


def tokenizer_class(path: str) -> Any:
    """The class that loads the checkpoint's tokenizer: the one its tokenizer_config.json names when
    that is a tokenizers-backed class listed above (imported alone), else `AutoTokenizer`."""
    import transformers  # lazy: an attribute below imports only its own module

    config = read_json(path, "tokenizer_config.json", required=False) or {}
    name = config.get("tokenizer_class")
    if name in DIRECT_TOKENIZER_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(path: str) -> Any:
    try:
        return tokenizer_class(path).from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise CheckpointError(f"{path}: cannot load the tokenizer ({exc})") from exc


def generation_defaults(path: str, tokenizer: Any) -> GenerationDefaults:
    """The checkpoint's generation_config.json (sampling defaults, eos ids) plus the tokenizer's eos."""
    cfg = read_json(path, "generation_config.json", required=False) or {}
    extra = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return GenerationDefaults.from_dict(cfg, extra)
