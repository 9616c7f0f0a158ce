"""Structured output (`SamplingParams.json_schema`) and OpenAI's frequency and presence penalties:
the sampler's mask and penalties against plain references, outputs that validate against their
schemas, constrained rows batched with free ones without changing them, the two-part constrained
step (simulated graphs, overlapped schedule) equal to eager, and errors named."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from mmpipe.language.sampler import RowSampling, SamplerTensors, SamplerVariant, advance, sample

from mmpipe import GraphConfig, InputError, Pipeline, SamplingParams
from mmpipe.engine.grammar import Grammars, fill_masks, mask_width
from tests.unit.test_decode_graphs import simulated_graphs  # noqa: F401  (a fixture)

CPU = torch.device("cpu")
SCENE = "assets/images/scene_0.png"

SCENE_SCHEMA = {
    "type": "object",
    "properties": {
        "scene": {"type": "string", "maxLength": 40},
        "shapes": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "kind": {"enum": ["photo", "drawing"]},
    },
    "required": ["scene", "shapes", "tags", "kind"],
    "additionalProperties": False,
}


def _image_chat(image: str = SCENE, text: str = "Describe the picture.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


# ---------------------------------------------------------------------------- the sampler

def _random_masks(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    bits = torch.rand(rows, vocab, generator=generator) < 0.3
    bits[:, 0] = False  # token 0 disallowed: an argmax over -inf everywhere would pick it
    bits[torch.arange(rows), torch.randint(1, vocab, (rows,), generator=generator)] = True  # never empty
    packed = np.zeros((rows, mask_width(vocab)), dtype=np.uint32)
    for r, t in bits.nonzero().tolist():
        packed[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(packed.view(np.int32)), bits


def test_the_mask_keeps_exactly_the_allowed_tokens_greedy_and_sampled():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 6, 77  # a vocabulary that is not a multiple of 32
    logits = torch.randn(rows, vocab, generator=g) * 3
    allowed, bits = _random_masks(rows, vocab, g)
    greedy_rows = [RowSampling(grammar=True) for _ in range(rows)]
    t = SamplerTensors.build(greedy_rows, vocab, CPU)
    t.allowed = allowed
    result = sample(logits, t, SamplerVariant.of(greedy_rows))
    expected = logits.masked_fill(~bits, float("-inf")).argmax(-1)
    assert torch.equal(result.tokens, expected)
    assert not torch.equal(expected, logits.argmax(-1))  # the mask changed something
    # Sampled rows: thousands of draws never leave the mask.
    sampled = [RowSampling(temperature=1.0, seed=s, step=k, grammar=True) for s in range(40) for k in range(50)]
    t = SamplerTensors.build(sampled, vocab, CPU)
    t.allowed = allowed[0:1].expand(len(sampled), -1).contiguous()
    drawn = sample(logits[0:1].expand(len(sampled), -1), t, SamplerVariant.of(sampled)).tokens
    assert bits[0, drawn].all() and len(set(drawn.tolist())) > 1


def test_an_all_ones_mask_leaves_a_row_bit_identical():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=g)
    rows = [RowSampling(temperature=0.8, top_p=0.9, seed=i, logprobs=4) for i in range(3)]
    plain = sample(logits, SamplerTensors.build(rows, 64, CPU), SamplerVariant.of(rows))
    t = SamplerTensors.build(rows, 64, CPU)
    t.allowed = torch.full((3, 2), -1, dtype=torch.int32)
    masked = sample(logits, t, SamplerVariant.of([RowSampling(grammar=True)] + rows))
    assert torch.equal(plain.tokens, masked.tokens) and torch.equal(plain.top_logprobs, masked.top_logprobs)


def test_frequency_and_presence_penalties_follow_openais_rule():
    g = torch.Generator().manual_seed(2)
    vocab = 40
    logits = torch.randn(3, vocab, generator=g)
    outputs = [(5, 5, 5, 7), (7,), ()]
    rows = [RowSampling(frequency=f, presence=p, output_ids=o, logprobs=vocab)
            for f, p, o in zip((0.7, -0.4, 1.5), (0.3, 1.0, 2.0), outputs)]
    result = sample(logits, SamplerTensors.build(rows, vocab, CPU), SamplerVariant.of(rows))
    expected = logits.clone()
    for r, (row, ids) in enumerate(zip(rows, outputs)):
        for token in set(ids):
            expected[r, token] -= row.frequency * ids.count(token) + row.presence
    assert torch.equal(result.tokens, expected.argmax(-1))
    assert result.tokens[0].item() != logits[0].argmax().item() or logits[0].argmax().item() not in (5, 7)
    # Logprobs stay those of the model's distribution.
    assert torch.allclose(result.top_logprobs.sort(-1).values, torch.log_softmax(logits, -1).sort(-1).values)


def test_advance_counts_generated_tokens_as_rebuilding_from_the_host_does():
    vocab = 16
    rows = [RowSampling(frequency=0.5, presence=0.25, output_ids=(3,)), RowSampling(frequency=1.0)]
    t = SamplerTensors.build(rows, vocab, CPU)
    variant = SamplerVariant.of(rows)
    history = [[3], []]
    for tokens in ([3, 4], [9, 4], [3, 4]):
        advance(t, torch.tensor(tokens), variant, torch.tensor([True, True]))
        for h, token in zip(history, tokens):
            h.append(token)
    rebuilt = SamplerTensors.build([RowSampling(frequency=0.5, presence=0.25, output_ids=history[0]),
                                    RowSampling(frequency=1.0, output_ids=history[1])], vocab, CPU)
    assert torch.equal(t.counts, rebuilt.counts) and t.counts[0, 3].item() == 3
    advance(t, torch.tensor([1, 1]), variant, torch.tensor([False, True]))  # an inactive row stays
    assert t.counts[0, 1].item() == 0 and t.counts[1, 1].item() == 1


class OpenAIPenalties:
    """transformers logits processor applying OpenAI's rule over the generated ids (the reference)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row in range(scores.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len:], minlength=scores.shape[1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def test_output_penalties_in_decoding_match_transformers_with_the_rule(checkpoint):
    """Counts live on the device and advance inside the step; transformers' greedy generate with
    the rule as a logits processor is the oracle."""
    from transformers import LogitsProcessorList

    from tests.helpers import hf_inputs, hf_model
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu")
    model = hf_model(checkpoint)
    conversation = [{"role": "user", "content": "tell me a story about a fox"}]
    inputs = hf_inputs(checkpoint, conversation)
    prompt_len = inputs["input_ids"].shape[1]
    plain = pipe.chat(conversation, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0))[0]
    for frequency, presence in ((1.5, 0.0), (0.0, 2.0), (-0.5, 0.8)):
        ours = pipe.chat(conversation, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0,
                                                      frequency_penalty=frequency, presence_penalty=presence))[0]
        out = model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
                             eos_token_id=None, top_k=None, top_p=None, temperature=None,
                             logits_processor=LogitsProcessorList([OpenAIPenalties(prompt_len, frequency, presence)]))
        assert ours.token_ids == out[0, prompt_len:].tolist(), (frequency, presence)
        assert ours.token_ids != plain.token_ids  # the knob acts


# ---------------------------------------------------------------------------- grammars

def test_fill_masks_writes_only_the_named_rows(pipe):
    grammars = Grammars(pipe.processor.tokenizer, 512, [2])
    matcher = grammars.matcher(json.dumps({"type": "object"}), "t")
    masks = np.full((3, mask_width(512)), 7, dtype=np.int32)
    fill_masks([(matcher, 1)], masks)
    assert (masks[0] == 7).all() and (masks[2] == 7).all()
    allowed = [t for t in range(512) if (int(masks[1, t // 32]) >> (t % 32)) & 1]
    assert [pipe.processor.tokenizer.decode([t]) for t in allowed] == ["{"]  # an object opens with "{" only
    assert grammars.matcher(json.dumps({"type": "object"}), "t").accept(allowed[0]) is None


# ---------------------------------------------------------------------------- the pipeline

@pytest.fixture(scope="module")
def bundled():
    with Pipeline.from_pretrained(device="cpu") as pipeline:
        yield pipeline


def test_outputs_validate_against_their_schemas(bundled):
    schemas = [SCENE_SCHEMA, {"type": "object"},
               {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 2,
                "maxItems": 4}]
    params = [SamplingParams(json_schema=s, max_new_tokens=120) for s in schemas]
    params.append(SamplingParams(json_schema=SCENE_SCHEMA, temperature=1.0, seed=5, max_new_tokens=120))
    params.append(SamplingParams(json_schema=json.dumps(SCENE_SCHEMA), temperature=0.7, top_k=20, seed=9,
                                 frequency_penalty=0.5, max_new_tokens=120))
    outputs = bundled.chat([_image_chat()] * len(params), params)
    for out, p in zip(outputs, params):
        assert out.error is None and out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), json.loads(p.json_schema))
    free = bundled.chat([_image_chat()], SamplingParams(max_new_tokens=20))[0].text
    with pytest.raises(ValueError):
        json.loads(free)  # the model alone writes a caption, not JSON: the grammar did the work


def test_free_rows_beside_constrained_rows_are_unchanged(bundled):
    """A free row's mask allows every token: its tokens equal those it gets alone, and its
    logprobs too (within the rounding a different batch size brings to the CPU's products)."""
    free = SamplingParams(max_new_tokens=24, logprobs=3, temperature=0.8, seed=1)
    mixed = bundled.chat([_image_chat(), _image_chat(text="What is there?"), _image_chat()],
                         [SamplingParams(json_schema=SCENE_SCHEMA, max_new_tokens=80), free,
                          SamplingParams(json_schema={"type": "object"}, max_new_tokens=40)])
    assert mixed[0].text.startswith("{") and mixed[2].text.startswith("{")
    together = mixed[1]
    reference = bundled.chat([_image_chat(text="What is there?")], free)[0]
    assert together.token_ids == reference.token_ids
    for a, b in zip(together.logprobs, reference.logprobs):
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-5


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_steps_in_graphs_equal_eager(checkpoint, simulated_graphs, overlap):  # noqa: F811
    """Simulated decode graphs (buckets 1, 2, 4): the constrained step's forward and sampler graphs
    are captured per bucket and serve constrained and free rows together; tokens and logprobs
    equal eager decoding, with the schedule overlapped or not."""
    kw = dict(device="cpu", max_running_requests=6, overlap_schedule=overlap)
    graphs = Pipeline.from_pretrained(checkpoint, decode_graph=GraphConfig(buckets=(1, 2, 4), max_graphs=16), **kw)
    eager = Pipeline.from_pretrained(checkpoint, decode_graph=GraphConfig(enabled=False), **kw)
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    params = [SamplingParams(max_new_tokens=10 + i, temperature=0.9 if i % 2 else 0.0, seed=i, logprobs=2,
                             json_schema=schema if i % 3 != 1 else None, frequency_penalty=0.3 * (i == 2))
              for i in range(6)]
    for count in (3, 6):
        ours = graphs.chat([conversation] * count, params[:count])
        reference = eager.chat([conversation] * count, params[:count])
        assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
        assert [o.text[:1] for o, p in zip(ours, params) if p.json_schema] == ["{"] * sum(
            1 for p in params[:count] if p.json_schema)
        for a, b in zip(ours, reference):
            for da, db in zip(a.logprobs, b.logprobs):
                assert da.keys() == db.keys() and max(abs(da[t] - db[t]) for t in da) < 1e-5
    decode = graphs.stats()["decode"]
    assert decode["graph_runs"] > 0 and decode["eager_runs"] > 0  # 5 and 6 rows: above the largest bucket
    labels = graphs.runner.decoder.cache.live_keys()
    assert any(key[1] == "logits" for key in labels) and any(
        not isinstance(key[1], str) and key[1].grammar for key in labels)


def test_overlapped_constrained_decoding_equals_the_plain_order(bundled, checkpoint):
    plain = Pipeline.from_pretrained(device="cpu", overlap_schedule=False)
    overlapped = Pipeline.from_pretrained(device="cpu", overlap_schedule=True)
    params = [SamplingParams(json_schema=SCENE_SCHEMA, max_new_tokens=100),
              SamplingParams(json_schema=SCENE_SCHEMA, temperature=1.0, seed=3, max_new_tokens=100),
              SamplingParams(max_new_tokens=30)]
    chats = [_image_chat(), _image_chat("assets/images/scene_1.png"), _image_chat()]
    a, b = plain.chat(chats, params), overlapped.chat(chats, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert overlapped.engine.overlap and not plain.engine.overlap


def test_a_preempted_constrained_request_resumes_its_grammar(checkpoint):
    """A small KV pool preempts requests mid-output; each resumes from its tokens with its grammar
    where it was (and its output penalties counted from its output), as when run alone."""
    schema = {"type": "array", "items": {"type": "integer"}}
    params = [SamplingParams(json_schema=schema, max_new_tokens=40, frequency_penalty=0.4),
              SamplingParams(max_new_tokens=40, ignore_eos=True, presence_penalty=0.6)] * 2
    conversation = [{"role": "user", "content": "count"}]
    tight = Pipeline.from_pretrained(checkpoint, device="cpu", num_kv_pages=28, kv_page_size=4)
    roomy = Pipeline.from_pretrained(checkpoint, device="cpu")
    ours = tight.chat([conversation] * 4, params)
    assert tight.stats()["requests"]["preemptions"] > 0  # the situation under test happened
    for out, p in zip(ours, params):
        assert out.token_ids == roomy.chat([conversation], p)[0].token_ids


def test_schema_errors_are_named_and_spare_the_other_requests(bundled):
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    with pytest.raises(InputError, match="json_schema cannot be compiled: .*look-around"):
        SamplingParams(json_schema=bad)
    # Past SamplingParams (a schema only the tokenizer's vocabulary could refuse): that request
    # fails, named; the others complete.
    params = SamplingParams(max_new_tokens=8)
    object.__setattr__(params, "json_schema", json.dumps(bad))
    outputs = bundled.chat([_image_chat(), _image_chat()], [params, SamplingParams(max_new_tokens=8)])
    assert outputs[0].error and "json_schema cannot be compiled" in outputs[0].error
    assert outputs[1].error is None and outputs[1].text
    with pytest.raises(InputError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(InputError, match="json_schema: give a JSON Schema object"):
        SamplingParams(json_schema=["type", "object"])
    with pytest.raises(InputError, match="min_new_tokens cannot be combined with json_schema"):
        SamplingParams(json_schema={"type": "object"}, min_new_tokens=2)
    for name in ("frequency_penalty", "presence_penalty"):
        with pytest.raises(InputError, match=name):
            SamplingParams(**{name: 2.5})


def test_startup_captures_the_output_penalty_graphs_before_any_row_uses_them(checkpoint, simulated_graphs):  # noqa: F811
    """Their buffers are made for the capture, not when the first row joins: no capture fails,
    and the steps of such requests replay graphs."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0, frequency_penalty=0.5)
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", startup_sampling=params,
                                    decode_graph=GraphConfig(buckets=(1, 2, 4), max_graphs=16))
    decode = pipe.stats()["decode"]
    assert decode["captures"] >= 3 and decode["capture_failures"] == 0
    before = decode["graph_runs"]
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    ours = pipe.chat([conversation] * 3, params)
    assert pipe.stats()["decode"]["graph_runs"] > before and pipe.stats()["decode"]["capture_failures"] == 0
    eager = Pipeline.from_pretrained(checkpoint, device="cpu", decode_graph=GraphConfig(enabled=False))
    assert [o.token_ids for o in ours] == [o.token_ids for o in eager.chat([conversation] * 3, params)]


def test_the_grammar_tokenizer_built_ahead_serves_like_one_built_on_demand(checkpoint):
    """`prepare_structured_output` builds llguidance's tokenizer on a thread of its own, from a
    tokenizer of its own; requests then get the same constrained tokens as when the first request
    builds it."""
    schema = {"type": "array", "items": {"type": "integer"}}
    params = SamplingParams(max_new_tokens=12, json_schema=schema)
    conversation = [{"role": "user", "content": "count"}]
    ahead = Pipeline.from_pretrained(checkpoint, device="cpu")
    ahead.prepare_structured_output()
    grammars = ahead.processor.grammars
    assert grammars._built.wait(60) and grammars._tokenizer is not None
    assert grammars._tokenizer is not None and grammars._hf is ahead.processor.tokenizer
    lazy = Pipeline.from_pretrained(checkpoint, device="cpu")
    assert ahead.chat(conversation, params)[0].token_ids == lazy.chat(conversation, params)[0].token_ids
    assert lazy.processor.grammars._tokenizer is not None


def test_constrained_steps_make_room_for_their_graphs(checkpoint, simulated_graphs):  # noqa: F811
    """Three buckets and room for three graphs (the greedy ones): the first constrained step makes
    room for its forward and sampler graphs too, so free and constrained requests taking turns
    evict nothing."""
    pipe = Pipeline.from_pretrained(checkpoint, device="cpu", max_running_requests=4,
                                    decode_graph=GraphConfig(buckets=(1, 2, 4), max_graphs=3))
    conversation = [{"role": "user", "content": "tell me about the picture"}]
    free = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0)
    constrained = SamplingParams(max_new_tokens=6, temperature=0.0, json_schema={"type": "array"})
    for _ in range(2):
        pipe.chat([conversation] * 4, [free, constrained, free, constrained])
        pipe.chat([conversation], free)
    decode = pipe.stats()["decode"]
    assert decode["evictions"] == 0 and decode["graph_runs"] > 0
    assert pipe.runner.decoder.cache.max_graphs == 9
