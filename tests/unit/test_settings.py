"""`mmpipe.settings`: every variable the library reads is in the module's table (and no other
module reads one), each name `MMPIPE_DISABLE` takes turns off exactly its own optimisation, and
unknown names and retired variables are refused by name."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

import mmpipe.settings as settings_module
from mmpipe.errors import InputError
from mmpipe.settings import DISABLE_NAMES, Settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sources() -> list[str]:
    out = []
    for folder in ("mmpipe", "vision", "language", "app"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return out


def test_every_variable_the_library_names_is_in_the_table():
    table = settings_module.variables()
    assert table[:3] == ["MMPIPE_MODEL", "MMPIPE_CACHE_DIR", "MMPIPE_DISABLE"]
    named = set()
    for path in _sources():
        named |= set(re.findall(r"\bMMPIPE_[A-Z0-9_]+\b", open(path, encoding="utf-8").read()))
    retired = set(settings_module._RETIRED)
    assert named - retired <= set(table), sorted(named - retired - set(table))


def test_only_the_settings_module_reads_the_environment_for_mmpipe():
    for path in _sources():
        if path.endswith(os.path.join("mmpipe", "settings.py")):
            continue
        text = open(path, encoding="utf-8").read()
        assert not re.search(r"(environ(\.get)?\(|getenv\()\s*['\"]MMPIPE_", text), path
        assert not re.search(r"environ\[['\"]MMPIPE_", text), path


# Written out here, not read from the module: a name mapped to the wrong field must fail.
TURNS_OFF = {"gemv": "gemv", "pdl": "pdl", "pdl-prefetch": "pdl_prefetch", "decode-rope-fusion": "decode_rope_fused",
             "decode-norm-fusion": "decode_norm_fused", "triton-direct-launch": "triton_direct",
             "prefill-plans": "prefill_plans", "fp8-fused-quant": "fp8_fused_quant",
             "fp8-triton-gemm": "fp8_triton_gemm", "blocking-sync": "blocking_sync",
             "extend-decode-rows": "extend_decode_rows"}


def test_the_disable_names_are_the_documented_ones():
    assert list(DISABLE_NAMES) == list(TURNS_OFF)


@pytest.mark.parametrize("name", list(TURNS_OFF))
def test_each_disable_name_turns_off_its_own_switch_only(name):
    defaults = Settings.from_environ({})
    off = Settings.from_environ({"MMPIPE_DISABLE": f" {name.upper()} "})
    changed = [f.name for f in dataclasses.fields(Settings) if getattr(off, f.name) != getattr(defaults, f.name)]
    assert changed == [TURNS_OFF[name]] and getattr(defaults, TURNS_OFF[name]) is True
    assert f"| `{name}` |" in settings_module.__doc__


def test_several_names_at_once_and_the_other_variables():
    env = {"MMPIPE_DISABLE": "gemv,pdl", "MMPIPE_CHECK_GRAPH_INPUTS": "yes", "MMPIPE_MODEL": "/m",
           "MMPIPE_CACHE_DIR": "/c", "MMPIPE_CAPTION_SHARD_STATUS": "/s"}
    got = Settings.from_environ(env)
    assert (got.gemv, got.pdl, got.pdl_prefetch) == (False, False, True)
    assert got.check_graph_inputs and got.model == "/m" and str(got.cache_dir) == "/c"
    assert got.caption_shard_status == "/s"
    assert Settings.from_environ({"XDG_CACHE_HOME": "/x"}).cache_dir.as_posix() == "/x/mmpipe"


def test_unknown_names_bad_flags_and_retired_variables_are_refused_by_name():
    with pytest.raises(InputError, match=r"unknown name\(s\) pld; known: gemv, pdl"):
        Settings.from_environ({"MMPIPE_DISABLE": "gemv,pld"})
    with pytest.raises(InputError, match="MMPIPE_CHECK_GRAPH_INPUTS='maybe'"):
        Settings.from_environ({"MMPIPE_CHECK_GRAPH_INPUTS": "maybe"})
    with pytest.raises(InputError, match="MMPIPE_PDL is no longer read: use MMPIPE_DISABLE=pdl"):
        Settings.from_environ({"MMPIPE_PDL": "0"})
