"""What the grammar engine (llguidance) makes of a JSON Schema before any tokenizer is known: the
layout of the JSON it writes, and whether it can compile the schema at all. Below the engine, so
`SamplingParams` can refuse a bad schema where it is given (`mmpipe.engine.grammar` builds the
matchers)."""

from __future__ import annotations

import functools

# The JSON's layout, fixed: one line with ", " and ": " between items (Python's `json.dumps`), the
# form models mostly write. Whitespace left free lets a model spend its tokens on blank lines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=256)  # a server sees the same few schemas again and again
def schema_error(schema: str) -> str | None:
    """What the grammar engine finds wrong with a JSON Schema (canonical JSON text) before any
    tokenizer is known (None: nothing), so a bad schema is refused where it is given."""
    try:
        import llguidance
    except ImportError as exc:
        return f"json_schema needs the llguidance package ({exc})"
    try:
        error = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc)
    return summary(error) if error else None


def summary(text: str, limit: int = 400) -> str:
    """A grammar engine's message (several lines, e.g. a regex with a caret under it) on one line."""
    line = " ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return line if len(line) <= limit else line[:limit] + " ..."
