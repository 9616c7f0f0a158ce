"""Piecewise prefill graphs against the eager prefill (the oracle for every graph mode), float32:
greedy tokens for token counts on a schedule size, between sizes and above the largest, with and
without images, chunked prefill mixed with decode, with the `eager` and `inductor` piece
compilers, and a second start from a warm compile cache. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest

from mmpipe import GraphConfig, Pipeline, SamplingParams
from tests.helpers import random_image

pytestmark = pytest.mark.gpu

IMAGES = [random_image(70 + 41 * i, 60 + 23 * i, seed=80 + i) for i in range(3)]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.0)


def conversation(i: int, words: int):
    content = [{"type": "image", "image": IMAGES[i % 3]}] if i % 2 == 0 else []
    content.append({"type": "text", "text": " ".join(["describe the colours and shapes"] * words)})
    return [{"role": "user", "content": content}]


CONVERSATIONS = [conversation(i, 1 + 3 * i) for i in range(4)]  # two with an image, two text only


def make(checkpoint: str, mode: str, **options) -> Pipeline:
    options.setdefault("decode_graph", GraphConfig(buckets=(1, 2, 4)))
    return Pipeline.from_pretrained(checkpoint, device="cuda", dtype="float32", num_kv_pages=1024,
                                    max_running_requests=4, graph_mode=mode, **options)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Eager prefill (graph mode `full_decode_only`: decode graphs as in the runs compared, prefill
    eager): each conversation alone, then all four together."""
    pipe = make(checkpoint, "full_decode_only")
    alone = [pipe.chat([c], PARAMS)[0] for c in CONVERSATIONS]
    together = pipe.chat(CONVERSATIONS, PARAMS)
    assert pipe.stats()["prefill"]["eager_runs"] > 0
    pipe.close()
    return alone, together


def tokens(outputs):
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_on_between_and_above_schedule_sizes_equal_eager(checkpoint, reference, mode):
    alone, together = reference
    lengths = [o.num_prompt_tokens for o in alone]
    # Sizes: exactly the first two prompts' lengths, one between the others, none for the batch.
    schedule = (lengths[0], lengths[1], max(lengths[2:]) + 5)
    # Without the prefix cache: each prompt is prefilled whole, in one step of its own length.
    pipe = make(checkpoint, mode, prefill_graph=GraphConfig(buckets=schedule), max_prefill_tokens=512,
                prefix_caching=False)
    stats = pipe.stats()["prefill"]
    # Pieces captured from the eager forward: nothing traced, one piece more than attention calls.
    assert stats["enabled"] and stats["graphs"] == 3 * stats["detail"]["pieces"] and not stats["detail"]["traced"]
    assert stats["detail"]["split_points"] == pipe.runner.model.language.num_layers
    ours = [pipe.chat([c], PARAMS)[0] for c in CONVERSATIONS]
    assert tokens(ours) == tokens(alone)
    after = pipe.stats()["prefill"]
    assert after["graph_runs"] == 4 and after["detail"]["padded_tokens"] == sum(schedule[2] - n for n in lengths[2:])
    assert tokens(pipe.chat(CONVERSATIONS, PARAMS)) == tokens(together)  # sum of all four: above the largest
    assert pipe.stats()["prefill"]["detail"]["compiled_runs"] == 1
    pipe.close()


def test_chunked_prefill_mixed_with_decode_equals_eager(checkpoint, reference):
    """A 48-token budget: long prompts are cut into chunks that run in steps between decodes."""
    _, together = reference
    pipe = make(checkpoint, "full_and_piecewise", max_prefill_tokens=48)
    assert pipe.stats()["prefill"]["sizes"][-1] == 48
    assert tokens(pipe.chat(CONVERSATIONS, PARAMS)) == tokens(together)
    stats = pipe.stats()
    assert stats["prefill"]["graph_runs"] >= 4 and stats["decode"]["graph_runs"] > 0
    pipe.close()


def test_inductor_pieces_and_a_warm_compile_cache_give_the_same_tokens(checkpoint, reference, tmp_path):
    _, together = reference
    options = dict(prefill_compiler="inductor", compile_cache_dir=str(tmp_path), max_prefill_tokens=256)
    cold = make(checkpoint, "full_and_piecewise", **options)
    cold_stats = cold.stats()["prefill"]["detail"]
    # first piece, one for all the middle layers' pieces, last piece
    assert cold_stats["compiler"] == "inductor" and cold_stats["compilations"] == min(3, cold_stats["pieces"])
    assert tokens(cold.chat(CONVERSATIONS, PARAMS)) == tokens(together)
    cold.close()
    warm = make(checkpoint, "full_and_piecewise", **options)
    warm_stats = warm.stats()["prefill"]["detail"]
    assert warm_stats["compilations"] == 0 and warm_stats["compile_cache_loads"] == cold_stats["compilations"]
    assert tokens(warm.chat(CONVERSATIONS, PARAMS)) == tokens(together)
    warm.close()


def test_replays_read_the_addresses_they_were_captured_with(checkpoint, switch, reference):
    """With the address check on, every replay compares its inputs' addresses with its capture's."""
    switch("MMPIPE_CHECK_GRAPH_INPUTS", "1")
    _, together = reference
    pipe = make(checkpoint, "full_and_piecewise", max_prefill_tokens=128)
    assert pipe.runner.prefiller.state.check_inputs
    assert tokens(pipe.chat(CONVERSATIONS, PARAMS)) == tokens(together)
    pipe.close()


def test_prefill_and_decode_graphs_share_one_pool(checkpoint):
    pipe = make(checkpoint, "full_and_piecewise", max_prefill_tokens=64)
    runner = pipe.runner
    assert runner.prefiller.cache.memory is runner.decoder.cache.memory
    pipe.chat(CONVERSATIONS[:2], PARAMS)
    stats = pipe.stats()
    assert stats["prefill"]["replays"] > 0 and stats["decode"]["graph_runs"] > 0
    pipe.close()


def test_graph_memory_of_a_schedule_stays_near_its_largest_size(checkpoint):
    """Pieces captured from the eager forward hold the split points' tensors and the output as weak
    references: a size's intermediates go back to the pool, so eight sizes cost about what the
    largest costs alone (holding them would add every size's attention tensors and outputs)."""
    sizes = (256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    held = {}
    for schedule in (sizes[-1:], sizes):
        pipe = make(checkpoint, "full_and_piecewise", max_prefill_tokens=2048,
                    prefill_graph=GraphConfig(buckets=schedule))
        stats = pipe.stats()["prefill"]
        assert stats["graphs"] == len(schedule) * stats["detail"]["pieces"]
        held[len(schedule)] = stats["memory_bytes"]
        assert tokens(pipe.chat(CONVERSATIONS[:2], PARAMS))  # the graphs run
        pipe.close()
    print(f"prefill graph memory: largest size alone {held[1] / 2**20:.1f} MiB, {len(sizes)} sizes "
          f"{held[len(sizes)] / 2**20:.1f} MiB")
    # With weak references all eight sizes hold about what the largest alone holds; with strong
    # references they held markedly more (docs/performance.md).
    assert held[1] > 0 and held[len(sizes)] - held[1] <= 4 * 2**20
