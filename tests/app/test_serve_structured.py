"""`mmpipe serve`'s structured output and OpenAI's penalties, driven by the real `openai` client:
`response_format` json_schema and json_object answers that validate, streamed too, equal to the
Python API's; a schema the grammar engine cannot compile answered 400; penalties that act."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from mmpipe.app.serve import on_loopback as serving
from mmpipe.app.serve_api import create_app

from mmpipe import SamplingParams
from tests.app.test_serve import KEY, SCENE, _data_uri, _image_message

SCHEMA = {
    "type": "object",
    "properties": {
        "scene": {"type": "string", "maxLength": 40},
        "shapes": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["scene", "shapes", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(engine):
    with serving(create_app(engine, served_model_name="tiny", api_key=KEY)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_json_schema_answers_validate_and_equal_the_python_api(client, pipe):
    messages = _image_message(_data_uri(SCENE))
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=120, temperature=0,
                                           response_format=FORMAT)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    ours = pipe.chat(messages, SamplingParams(max_new_tokens=120, temperature=0, json_schema=SCHEMA))[0]
    assert text == ours.text and reply.usage.completion_tokens == len(ours.token_ids)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=120, temperature=0,
                                              response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    sampled = client.chat.completions.create(model="tiny", messages=messages, max_tokens=120, temperature=1.0,
                                             seed=4, n=2, response_format=FORMAT)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_answers_are_objects(client):
    reply = client.chat.completions.create(model="tiny", messages=_image_message(_data_uri(SCENE)), max_tokens=60,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    # The completions endpoint takes it too (in the body: the SDK's completions have no such argument).
    schema = {"type": "object", "properties": {"seen": {"type": "boolean"}}, "required": ["seen"],
              "additionalProperties": False}
    plain = client.completions.create(model="tiny", prompt="A photo of", max_tokens=40, temperature=0)
    held = client.completions.create(model="tiny", prompt="A photo of", max_tokens=40, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "seen", "schema": schema}}})
    answer = json.loads(held.choices[0].text)
    assert list(answer) == ["seen"] and isinstance(answer["seen"], bool) and held.choices[0].finish_reason == "stop"
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].text)  # left free, the tiny model writes no JSON


def test_a_schema_the_grammar_engine_cannot_compile_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=bad)
    assert "json_schema cannot be compiled" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "yaml"})
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       frequency_penalty=3)
    # The server still answers.
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4).choices[0].message.content is not None


def test_frequency_and_presence_penalties_reach_the_sampler(client, pipe):
    """The server hands the penalties to the sampler: a seeded sampled answer equals the Python
    API's with them (the bundled model's captions are too sure for them to change greedy ones)."""
    from mmpipe.app.serve_protocol import sampling_of
    params, _ = sampling_of({"frequency_penalty": 1.5, "presence_penalty": -0.5}, chat=True)
    assert (params[0].frequency_penalty, params[0].presence_penalty) == (1.5, -0.5)
    story = [{"role": "user", "content": "Tell me a story."}]  # the tiny model is unsure here
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        reply = client.chat.completions.create(model="tiny", messages=story, max_tokens=30, temperature=1.0,
                                               seed=11, **kw)
        ours = pipe.chat(story, SamplingParams(max_new_tokens=30, temperature=1.0, seed=11, **kw))[0]
        plain = pipe.chat(story, SamplingParams(max_new_tokens=30, temperature=1.0, seed=11))[0]
        assert reply.choices[0].message.content == ours.text
        assert ours.token_ids != plain.token_ids
