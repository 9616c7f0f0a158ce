"""Conversations and the transformers comparison shared by the parity tests (CPU and GPU)."""

from __future__ import annotations

from mmpipe import Pipeline, SamplingParams
from tests.helpers import first_logits, hf_generate, hf_inputs, max_logprob_diff, random_image, rel_err

GREEDY_32 = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


def text_only():
    return [{"role": "user", "content": "Tell me a story about a fox."}]


def one_image():
    return [{"role": "user", "content": [{"type": "image", "image": random_image(200, 300, seed=1)},
                                         {"type": "text", "text": "Describe this image."}]}]


def two_images():
    return [{"role": "user", "content": [{"type": "image", "image": random_image(150, 100, seed=2)},
                                         {"type": "text", "text": "and"},
                                         {"type": "image", "image": random_image(260, 330, seed=3)},
                                         {"type": "text", "text": "compare the two pictures"}]}]


def multi_turn():
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "image", "image": random_image(90, 400, seed=4)},
                                         {"type": "text", "text": "Describe this image."}]},
            {"role": "assistant", "content": "a small green triangle at the bottom"},
            {"role": "user", "content": "héllo wörld ✓ 🙂"}]


CASES = {"text": text_only, "one_image": one_image, "two_images": two_images, "multi_turn": multi_turn}


def assert_matches(pipe: Pipeline, reference, path: str, conversation, device: str = "cpu",
                   logprob_tol: float = 1e-4, logits_tol: float = 1e-4) -> None:
    """First-step logits within `logits_tol` relative, 32 greedy tokens identical, every step's top
    logprobs within `logprob_tol` of transformers' (`reference`, on `device`)."""
    inputs = hf_inputs(path, conversation, device=device, videos=videos_of(pipe, conversation))
    ref_logits, ref_tokens, ref_steps = hf_generate(reference, inputs, 32)
    ours = first_logits(pipe, conversation)
    assert rel_err(ours, ref_logits) <= logits_tol, rel_err(ours, ref_logits)
    out = pipe.chat(conversation, GREEDY_32)[0]
    assert out.num_prompt_tokens == inputs["input_ids"].shape[1]
    assert out.token_ids == ref_tokens
    # Every step's distribution, not just the argmax: catches position or cache errors in decode.
    assert len(out.logprobs) == 32
    assert max_logprob_diff(out.logprobs, ref_steps) <= logprob_tol


def assert_chunked_matches(pipe: Pipeline, reference, path: str, conversation, device: str = "cpu",
                           logprob_tol: float = 1e-4) -> None:
    """32 greedy tokens identical to transformers' and their top logprobs within `logprob_tol`,
    for a pipeline whose prefill budget splits the prompt into at least four chunks (its
    first-step logits are not compared: `first_logits` prefills in one forward)."""
    inputs = hf_inputs(path, conversation, device=device, videos=videos_of(pipe, conversation))
    _, ref_tokens, ref_steps = hf_generate(reference, inputs, 32)
    out = pipe.chat(conversation, GREEDY_32)[0]
    assert out.num_prompt_tokens == inputs["input_ids"].shape[1] > 3 * pipe.engine.cfg.max_prefill_tokens
    assert out.token_ids == ref_tokens
    assert max_logprob_diff(out.logprobs, ref_steps) <= logprob_tol


def videos_of(pipe: Pipeline, conversation) -> list:
    """The conversation's videos as mmpipe samples and resizes them (what transformers' model is
    fed in the comparison; the sampling and the patches have their own oracles)."""
    from mmpipe.inputs import parse_conversation
    from mmpipe.video_parts import ChatVideo

    return [pipe.processor.load_image(item, "test") for item in parse_conversation(conversation).images
            if isinstance(item, ChatVideo)]
