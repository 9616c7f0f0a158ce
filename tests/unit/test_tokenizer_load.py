"""The tokenizer loads by its class name, without transformers' auto classes, and equals what
`AutoTokenizer` loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmpipe.pipeline import DEFAULT_MODEL_DIR
from mmpipe.tokenizer import load_tokenizer, tokenizer_class

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _copy_with_class(tmp_path: Path, name: str | None) -> str:
    for f in TOKENIZER_FILES:
        shutil.copy(Path(DEFAULT_MODEL_DIR) / f, tmp_path / f)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if name is None:
        config.pop("tokenizer_class", None)
    else:
        config["tokenizer_class"] = name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(Path(DEFAULT_MODEL_DIR) / "config.json", tmp_path / "config.json")
    return str(tmp_path)


@pytest.mark.parametrize("name", ["TokenizersBackend", "Qwen2Tokenizer", None])
def test_loaded_tokenizer_equals_auto_tokenizer(tmp_path: Path, name: str | None) -> None:
    from transformers import AutoTokenizer

    path = _copy_with_class(tmp_path, name)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(ours) is type(auto)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "A red bus, 12 km?"}]}]
    text = auto.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == text
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert (ours.eos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    assert ours.all_special_tokens == auto.all_special_tokens


def test_unknown_class_name_goes_through_auto_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert tokenizer_class(_copy_with_class(tmp_path, "SomethingElseTokenizer")) is AutoTokenizer
    assert tokenizer_class(_copy_with_class(tmp_path, None)) is AutoTokenizer


def test_start_up_does_not_import_transformers_model_code() -> None:
    """A Pipeline answers without importing transformers' model, generation or auto classes (they
    cost seconds of start-up and bring scikit-learn with them)."""
    code = ("import sys\nfrom mmpipe import Pipeline, SamplingParams\n"
            "pipe = Pipeline.from_pretrained(device='cpu')\n"
            "out = pipe.generate(['A photo of'], sampling=SamplingParams(max_new_tokens=2))[0]\nassert out.ok, out.error\n"
            "heavy = sorted(m for m in sys.modules if m.startswith(('sklearn', 'transformers.generation', "
            "'transformers.models.auto')))\nprint('HEAVY', heavy)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "HEAVY []" in result.stdout, result.stdout[-2000:]
