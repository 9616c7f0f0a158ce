"""The layout (docs/architecture.md): the dependency rule, checked on the source's imports (the
graph machinery, kernels and layers import no engine or model code; vision and language never
import each other; the engine reaches model code only through the registry, `mmpipe.models`); one
concern a module (no library file over 450 lines); and code prose without run logs (no timings,
GPU names, before -> after figures or commit hashes in library or test sources: figures live in
docs/performance.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"mmpipe.vision": ROOT / "vision", "mmpipe.language": ROOT / "language", "mmpipe": ROOT / "mmpipe"}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(path: Path) -> set[str]:
    """Every mmpipe module the file imports, at any depth (also inside functions and TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("mmpipe")}


def room(module: str) -> str:
    for prefix in ("mmpipe.vision", "mmpipe.language", "mmpipe.engine.scheduler", "mmpipe.engine",
                   "mmpipe.graphs", "mmpipe.kernels", "mmpipe.layers", "mmpipe.models"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return "mmpipe"


def arrows() -> set[tuple[str, str, str]]:
    """(from room, to room, file) for every import between modules that exist."""
    modules = module_files()
    out = set()
    for name, path in modules.items():
        for target in imports_of(path):
            if target in modules:
                out.add((room(name), room(target), str(path.relative_to(ROOT))))
    return out


FORBIDDEN = {
    "mmpipe.graphs": {"mmpipe.engine", "mmpipe.engine.scheduler", "mmpipe.vision", "mmpipe.language",
                      "mmpipe.models"},
    "mmpipe.kernels": {"mmpipe.engine", "mmpipe.engine.scheduler", "mmpipe.vision", "mmpipe.language",
                       "mmpipe.models", "mmpipe.graphs"},
    "mmpipe.layers": {"mmpipe.engine", "mmpipe.engine.scheduler", "mmpipe.vision", "mmpipe.language",
                      "mmpipe.models", "mmpipe.graphs"},
    # The types a runner and the engine both need live below both (`mmpipe.step_io`).
    "mmpipe.vision": {"mmpipe.language", "mmpipe.models", "mmpipe.engine", "mmpipe.engine.scheduler"},
    "mmpipe.language": {"mmpipe.vision", "mmpipe.models", "mmpipe.engine", "mmpipe.engine.scheduler"},
    "mmpipe.engine": {"mmpipe.vision", "mmpipe.language"},
    "mmpipe.engine.scheduler": {"mmpipe.vision", "mmpipe.language", "mmpipe.models"},
}


def test_the_rooms_import_only_what_the_layout_allows():
    found = arrows()
    assert any(src == "mmpipe.engine" and dst == "mmpipe.models" for src, dst, _ in found)  # the graph is read
    broken = sorted((src, dst, path) for src, dst, path in found if dst in FORBIDDEN.get(src, ()))
    assert not broken, broken


def test_one_optional_triton_guard():
    """Only `mmpipe/kernels/__init__.py` imports `triton` itself (under a guard); every other file
    takes `triton` and `tl` from it (a probe for an optional part of Triton, such as PDL's, is not
    a guard)."""
    guarded = []
    for path in module_files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name in ("triton", "triton.language") for a in node.names):
                guarded.append(str(path.relative_to(ROOT)))
    assert sorted(set(guarded)) == ["mmpipe/kernels/__init__.py"], guarded


LIBRARY = ("mmpipe", "vision", "language", "app")


def sources(folders: tuple[str, ...]) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def test_no_library_file_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources(LIBRARY) if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


# What a run log leaves in prose. Arithmetic arrows (`300 / 28 = 10.7 -> 11`) and sizes are fine.
RUN_LOG = {
    "a GPU name": re.compile(r"\b(H100|H200|H20|A100|A10G?|L40S?|B200|GB200|RTX ?\d{4})\b"),
    "a timing": re.compile(r"(?<![\w.])~?\d+(\.\d+)?\s?(ms|us|µs|ns)\b|\d\s?(images|tokens|files|steps|requests)/s\b"
                           r"|\d\s?(GB|TB|TFLOP)/s\b|(?<![\w.])~?\d+\.\d+\s?s\b"),
    "a before -> after figure": re.compile(r"\d[\d.]*\s*(ms|us|µs|s|%|x|MiB|GiB|/s)\s*(->|→)\s*~?\d"),
    "a commit hash": re.compile(r"(?<![\w])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}(?![\w])"),
}


def run_log_hits(text: str) -> list[tuple[int, str]]:
    """(line number, what) for each line of `text` that holds a run log's trace."""
    return [(number, what) for number, line in enumerate(text.splitlines(), 1)
            for what, pattern in RUN_LOG.items() if pattern.search(line)]


def test_library_and_test_prose_holds_no_run_log():
    this_file = Path(__file__).resolve()  # its own examples of what the patterns catch
    found = [f"{path.relative_to(ROOT)}:{number}: {what}" for path in sources((*LIBRARY, "tests"))
             if path.resolve() != this_file for number, what in run_log_hits(path.read_text())]
    assert not found, "\n".join(found[:40])


@pytest.mark.parametrize("line", ["3B fp8 batch 1 1.67 -> 1.60 ms/step", "on an H200 machine",
                                  "against the kernels of eac0d5f", "~2.3 s of start-up", "58 files/s",
                                  "norm 53% -> 38", "12.0-19.9 us against 28.6"])
def test_the_run_log_patterns_catch_what_they_are_for(line):
    allowed = "# 300 / 28 = 10.71 -> 11 -> 308; sizes 12 -> 16; a 1.5e-3 tolerance; 8 s timeout; 4096 x 11008"
    assert [number for number, _ in run_log_hits(f"# {line}\n{allowed}\n")] != []
    assert run_log_hits(allowed) == []
