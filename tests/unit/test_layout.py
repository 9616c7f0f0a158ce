"""The dependency rule of the layout (README, Layout), checked on the source's imports: the
graph machinery, kernels and layers import no engine or model code; vision and language never
import each other; the engine reaches model code only through the registry (`mmpipe.models`)."""

from __future__ import annotations

import ast
from pathlib import Path

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
    "mmpipe.vision": {"mmpipe.language", "mmpipe.models"},
    "mmpipe.language": {"mmpipe.vision", "mmpipe.models"},
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
