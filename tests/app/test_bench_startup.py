"""`mmpipe bench startup`'s child processes: the environment they run in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mmpipe.app.bench.startup import cache_env, child_env, warm_bytecode

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
