"""Structured output and the output penalties on the GPU: constrained and free rows decoding together
in every graph mode (the constrained step's forward and sampler graphs, the overlapped schedule)
give eager's float32 tokens; the bundled model's JSON validates in bfloat16; on two GPUs the
sharded Pipeline gives one GPU's constrained tokens. Run with `pytest -m gpu`."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from mmpipe import GraphConfig, Pipeline, SamplingParams
from tests.gpu.test_gpu_decode_graphs import assert_same, conversations

pytestmark = pytest.mark.gpu

ARRAY = {"type": "array", "items": {"type": "integer"}, "maxItems": 12}
OBJECT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
SCENE = {"type": "object", "properties": {"scene": {"type": "string", "maxLength": 40},
                                          "shapes": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["scene", "shapes"], "additionalProperties": False}


def mixed(n: int, sampled: bool = True) -> list[SamplingParams]:
    """Constrained (greedy and seeded) and free rows of different lengths, some with penalties."""
    out = []
    for i in range(n):
        schema = (ARRAY, None, OBJECT)[i % 3]
        out.append(SamplingParams(max_new_tokens=16 + 5 * i, temperature=0.9 if sampled and i % 2 == 0 else 0.0,
                                  seed=10 + i,
                                  logprobs=3, json_schema=schema, ignore_eos=schema is None,
                                  frequency_penalty=0.5 if i % 4 == 1 else 0.0,
                                  presence_penalty=0.7 if i % 4 == 3 else 0.0))
    return out


def make(checkpoint: str, mode: str, **options) -> Pipeline:
    return Pipeline.from_pretrained(checkpoint, device="cuda", dtype="float32", num_kv_pages=2048, graph_mode=mode,
                                    max_running_requests=8, decode_graph=GraphConfig(buckets=(1, 2, 4, 8)), **options)


@pytest.fixture(scope="module")
def eager(checkpoint):
    return make(checkpoint, "none", overlap_schedule=False)


@pytest.mark.parametrize("mode", ["full_decode_only", "full_and_piecewise"])
@pytest.mark.parametrize("count", [3, 8])
def test_constrained_and_free_rows_in_graphs_equal_eager(checkpoint, eager, mode, count):
    pipe = make(checkpoint, mode)
    try:
        assert pipe.engine.overlap  # the masks are filled while the step's forward runs
        params = mixed(count)
        ours, reference = pipe.chat(conversations(count), params), eager.chat(conversations(count), params)
        assert_same(ours, reference, first_tol=4e-6)
        for out, p in zip(ours, params):
            if p.json_schema and out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), json.loads(p.json_schema))
        decode = pipe.stats()["decode"]
        assert decode["graph_runs"] > 0 and decode["capture_failures"] == 0
        keys = pipe.runner.decoder.cache.live_keys()
        assert any(k[1] == "logits" for k in keys) and any(not isinstance(k[1], str) and k[1].grammar for k in keys)
    finally:
        pipe.close()


def test_the_bundled_models_json_validates_in_bfloat16():
    with Pipeline.from_pretrained(device="cuda", dtype="bfloat16") as pipe:
        chats = [[{"role": "user", "content": [{"type": "image", "image": f"assets/images/scene_{i}.png"},
                                               {"type": "text", "text": "Describe this image."}]}] for i in range(6)]
        params = [SamplingParams(max_new_tokens=100, json_schema=SCENE, temperature=0.0 if i % 2 else 1.0, seed=i)
                  for i in range(6)]
        for out in pipe.chat(chats, params):
            assert out.finish_reason == "stop", out
            jsonschema.validate(json.loads(out.text), SCENE)
        assert pipe.stats()["decode"]["graph_runs"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_two_gpus_give_one_gpus_constrained_tokens(checkpoint, mode):
    def run(size: int) -> list[list[int]]:
        pipe = Pipeline.from_pretrained(checkpoint, device="cuda:0", dtype="float32", graph_mode=mode,
                                        tensor_parallel_size=size, num_kv_pages=512)
        try:
            return [o.token_ids for o in pipe.chat(conversations(5), mixed(5, sampled=False), progress=False)]
        finally:
            pipe.close()

    assert run(2) == run(1)
