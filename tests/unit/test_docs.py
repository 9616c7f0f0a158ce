"""The documentation stays true to the code: configuration.md lists every `EngineConfig` and
`GraphConfig` field with its default and every environment variable and `MMPIPE_DISABLE` name;
every relative link and every repository path quoted in README.md and docs/ exists; every
`mmpipe` command quoted there parses; the README stays a page (at most 200 lines) and docs/ holds
guides, not run dumps."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from mmpipe import settings
from mmpipe.config import EngineConfig, GraphConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _rows(page: str) -> dict[str, list[str]]:
    """First cell (without backticks) -> the row's cells, for every table row of a page."""
    rows = {}
    for line in (ROOT / "docs" / page).read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells
    return rows


@pytest.mark.parametrize("cls", [EngineConfig, GraphConfig])
def test_configuration_lists_every_field_with_its_default(cls):
    rows = _rows("configuration.md")
    for field in dataclasses.fields(cls):
        assert field.name in rows, f"{cls.__name__}.{field.name} is missing from docs/configuration.md"
        default = field.default
        if default is None or isinstance(default, (bool, int, float, str)):
            shown = f'`"{default}"`' if isinstance(default, str) else f"`{default}`"
            assert rows[field.name][1].startswith(shown), (field.name, rows[field.name][1], shown)


def test_configuration_lists_every_environment_variable_and_disable_name():
    rows = _rows("configuration.md")
    for name in [*settings.variables(), *settings.DISABLE_NAMES]:
        assert name in rows, f"{name} is missing from docs/configuration.md"


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in _links(page.read_text()):
            if re.match(r"^[a-z]+://|^mailto:|^#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_repository_path_quoted_exists():
    """`mmpipe/engine/feed.py`, `tests/unit/test_layout.py`, `app/`: paths of the repository's own
    folders written in backticks (a module moved or renamed leaves its old path behind)."""
    missing = []
    for page in PAGES:
        for path in re.findall(r"`((?:mmpipe|vision|language|app|tests|assets|docs)/[\w./-]*)`", page.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_the_readme_is_a_page_and_docs_hold_guides():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    others = [p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix != ".py"]
    assert len(others) <= 60, len(others)
    assert not (ROOT / "docs" / "bench").exists()
    dumps = [p for p in (ROOT / "docs").rglob("*") if p.suffix in (".txt", ".sh", ".log")]
    assert not dumps, dumps


def _quoted_commands(program: str, spans: bool = False) -> list[str]:
    """Every `mmpipe <program> ...` command in the pages' code blocks (fenced or indented),
    continuation lines joined, shell comments dropped; with `spans`, in code spans too (where
    the performance tables quote the command behind each row; elsewhere a command named in
    running text is a reference, not a command to run)."""
    commands = []
    for page in PAGES:
        text = page.read_text()
        blocks = re.findall(r"```(?:\w*)\n(.*?)```", text, flags=re.S) + re.findall(r"^    (.*mmpipe .*)$", text, re.M)
        if spans:
            blocks += re.findall(r"`(mmpipe [^`]+)`", text)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                for part in re.split(r"&&|\||;", line):
                    part = re.sub(r"^(\w+=\S+ )+", "", part.strip())  # VARIABLE=value mmpipe ...
                    if part.startswith(f"mmpipe {program}"):
                        commands.append(part)
    return commands


def _parses(parse, words: list[str]) -> bool:
    try:
        parse(words)
    except SystemExit as exit_:
        return exit_.code == 0  # --help
    return True


def test_every_quoted_caption_demo_serve_and_info_command_parses():
    from mmpipe.cli import build_parser

    parser = build_parser()
    commands = [c for program in ("caption", "demo", "serve", "info") for c in _quoted_commands(program)]
    failing = [c for c in commands if "[" not in c and not _parses(parser.parse_args, shlex.split(c)[1:])]
    assert not failing, failing
    assert len(commands) >= 3


def test_every_quoted_bench_command_parses():
    """The command behind every figure (docs/performance.md, the README's table) runs as written."""
    from mmpipe.app.bench.main import build_parser

    parser = build_parser()
    commands = [c for c in _quoted_commands("bench", spans=True) if len(c.split()) > 2 and "<" not in c]
    failing = [c for c in commands if not _parses(parser.parse_args, shlex.split(c)[2:])]
    assert not failing, failing
    assert len([c for c in commands if c.split()[2:3] != ["-h"]]) >= 10
