"""`mmpipe bench startup`: its child processes' environment, and how it counts a caption run's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mmpipe.app.bench.startup import cache_env, caption_rows, child_env, warm_bytecode

_FLAGS = "import json, sys; print(json.dumps([sys.flags.dont_write_bytecode, sys.pycache_prefix]))"


def _child_flags(env: dict[str, str]) -> list:
    out = subprocess.run([sys.executable, "-c", _FLAGS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_bytecode_flag_makes_children_cache_their_bytecode(tmp_path, monkeypatch):
    """The GPU machines set PYTHONDONTWRITEBYTECODE=1; `--bytecode DIR` must give the children a
    cache, as an installed package has (else every process compiles every module's source)."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    caches = cache_env(str(tmp_path / "caches"))
    assert _child_flags(child_env(None, caches)) == [1, None]  # as the environment says
    cached = _child_flags(child_env(None, caches, str(tmp_path / "pyc")))
    assert cached == [0, str(tmp_path / "pyc")]


def test_children_get_the_compile_caches_and_the_tree_first(tmp_path):
    caches = cache_env(str(tmp_path))
    env = child_env(str(tmp_path / "old"), caches)
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path / "old")
    assert {k: env[k] for k in caches} == caches


def test_an_empty_bytecode_cache_is_filled_once_before_the_timed_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    folder = str(tmp_path / "pyc")
    env = child_env(None, cache_env(str(tmp_path / "caches")), folder)
    assert warm_bytecode(folder, [sys.executable, "-c", "import email.mime.text"], env, None)
    compiled = [name for _, _, names in os.walk(folder) for name in names if name.endswith(".pyc")]
    assert any(name.startswith("text.") for name in compiled)
    # Filled: nothing runs again (this command would fail if it did).
    assert not warm_bytecode(folder, [sys.executable, "-c", "raise SystemExit(3)"], env, None)


def test_caption_rows_count_empty_captions_and_refuse_real_errors(tmp_path):
    """Random weights end captions empty (an error row the tool writes after generating them):
    those count; any other error row means the measured run failed and must not pass as one."""
    from mmpipe.captioning import EMPTY_CAPTION

    output, errors = tmp_path / "captions.jsonl", tmp_path / "errors.jsonl"
    output.write_text('{"image": "a.jpg", "caption": "x"}\n\n')
    errors.write_text(json.dumps({"image": "b.jpg", "error": EMPTY_CAPTION}) + "\n")
    assert caption_rows(str(output), str(errors)) == (1, 1)
    with errors.open("a") as handle:
        handle.write(json.dumps({"image": "c.jpg", "error": "c.jpg: cannot identify the image"}) + "\n")
    with pytest.raises(RuntimeError, match="cannot identify"):
        caption_rows(str(output), str(errors))
    assert caption_rows(str(tmp_path / "none"), str(tmp_path / "none2")) == (0, 0)
