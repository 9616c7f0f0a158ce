"""How a benchmark shows and keeps its results: markdown tables on stdout, and the result
dictionary as JSON (`--json PATH` on every subcommand)."""

from __future__ import annotations

import json
from typing import Any


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(result, handle, indent=2)
