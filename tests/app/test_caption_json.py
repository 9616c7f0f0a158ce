"""`mmpipe caption --json-schema FILE`: every caption a JSON value that validates against the schema
(in every output format), a caption cut off by --max-new-tokens listed as a failure, and a schema
file that cannot be used refused before the model loads."""

from __future__ import annotations

import csv
import json

import jsonschema
import pytest
from mmpipe.app.caption import main

from tests.app.test_caption import CPU, dataset, one_model_load_per_module, read_jsonl, sidecar  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "scene": {"type": "string", "maxLength": 40},
        "shapes": {"type": "integer", "minimum": 0, "maximum": 9},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "orange", "other"]}, "maxItems": 3},
    },
    "required": ["scene", "shapes", "colors"],
    "additionalProperties": False,
}


@pytest.fixture()
def schema_file(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return str(path)


def test_every_caption_validates_in_every_format(dataset, tmp_path, schema_file):  # noqa: F811
    root, expected = dataset
    out = tmp_path / "captions.jsonl"
    assert main([str(root), "--output", str(out), "--json-schema", schema_file, "--max-new-tokens", "120", *CPU]) == 0
    records = read_jsonl(out)
    assert {r["image"] for r in records} == set(expected)
    for record in records:
        jsonschema.validate(json.loads(record["caption"]), SCHEMA)
    table = tmp_path / "captions.csv"
    assert main([str(root), "--format", "csv", "--output", str(table), "--json-schema", schema_file,
                 "--max-new-tokens", "120", *CPU]) == 0
    rows = list(csv.DictReader(open(table, encoding="utf-8")))
    assert len(rows) == len(expected)
    assert {r["image"]: r["caption"] for r in rows} == {r["image"]: r["caption"] for r in records}  # greedy: same
    assert main([str(root), "--format", "txt", "--json-schema", schema_file, "--max-new-tokens", "120", *CPU]) == 0
    for image in expected:
        jsonschema.validate(json.loads(open(sidecar(image), encoding="utf-8").read()), SCHEMA)


def test_a_caption_cut_off_is_a_failure_in_the_errors_file(dataset, tmp_path, schema_file):  # noqa: F811
    root, expected = dataset
    out, errors = tmp_path / "captions.jsonl", tmp_path / "errors.jsonl"
    code = main([str(root), "--output", str(out), "--json-schema", schema_file, "--max-new-tokens", "6",
                 "--errors-file", str(errors), *CPU])
    assert code == 1
    assert not out.exists() or read_jsonl(out) == []
    listed = {r["image"]: r["error"] for r in read_jsonl(errors)}
    assert set(listed) == set(expected) and all("cut off after 6 tokens" in e for e in listed.values())


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"), ("{not json", "not JSON"), ('["a"]', "give a JSON Schema object"),
    ('{"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}',
     "json_schema cannot be compiled"),
])
def test_a_schema_file_that_cannot_be_used_is_refused(dataset, tmp_path, capsys, content, message):  # noqa: F811
    root, _ = dataset
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "captions.jsonl"
    code = main([str(root), "--output", str(out), "--json-schema", str(path), *CPU])
    assert code == 2 and message in capsys.readouterr().err
