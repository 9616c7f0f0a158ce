"""Video prompts against transformers on tiny checkpoints of every family (float32, CPU):
greedy tokens and every step's top log-probabilities for one video, an image and a video, two
videos (a file and a list of frames), a multi-turn chat, and a video whose tokens are split
across prefill chunks. transformers' model is fed the frames mmpipe sampled and resized; the
prompt's tokens (Qwen3-VL's timestamps), the positions (Qwen2.5-VL's seconds) and the tower's
frame groups are what is compared. The sampling and the patches have their own oracles
(test_video_sampling.py, test_video_preprocess.py)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from mmpipe import Pipeline, SamplingParams
from tests.helpers import hf_model, make_checkpoint, random_image
from tests.parity_cases import assert_chunked_matches, assert_matches
from tests.video_helpers import make_video

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
GREEDY_8 = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return {
        # 3 s at 15 fps, sampled at 2 fps: 6 frames, 3 groups
        "mp4": make_video(folder / "a.mp4", 45, 120, 90, fps=15),
        # 29.97 fps, an odd size, another codec and container
        "mkv": make_video(folder / "b.mkv", 40, 97, 61, fps=Fraction(30000, 1001), codec="mjpeg"),
    }


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp(request.param)), family=request.param)
    pipe = Pipeline.from_pretrained(path, device="cpu")
    yield request.param, path, pipe, hf_model(path)
    pipe.close()


def video_part(source, **keys):
    return {"type": "video", "video": source, **keys}


def ask(*parts, text="Describe this image."):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_one_video(family, clips):
    _, path, pipe, reference = family
    assert_matches(pipe, reference, path, ask(video_part(clips["mp4"])))


def test_an_image_and_a_video_at_its_own_rate(family, clips):
    _, path, pipe, reference = family
    conversation = ask({"type": "image", "image": random_image(150, 100, seed=2)},
                       video_part(clips["mkv"], fps=6, min_pixels=20000, max_pixels=40000))
    assert_matches(pipe, reference, path, conversation)


def test_two_videos_a_file_and_a_list_of_frames(family, clips):
    _, path, pipe, reference = family
    frames = [random_image(64, 48, seed=10 + k) for k in range(5)]  # padded to 6 with its last frame
    conversation = ask(video_part(clips["mp4"], nframes=4, video_start=0.5, video_end=2.5),
                       {"type": "text", "text": "and"}, video_part(frames, sample_fps=1.5))
    assert_matches(pipe, reference, path, conversation)


def test_a_video_split_across_prefill_chunks(family, clips):
    """A prefill budget of 96 tokens: the video's groups (80 to 140 tokens each here) straddle
    chunk boundaries, and a later chunk starts inside a group."""
    _, path, _, reference = family
    pipe = Pipeline.from_pretrained(path, device="cpu", max_prefill_tokens=96)
    try:
        conversation = [{"role": "system", "content": "You are terse."}, *ask(video_part(clips["mp4"])),
                        {"role": "assistant", "content": "a small green triangle"},
                        {"role": "user", "content": "Tell me a story about a fox."}]
        assert_chunked_matches(pipe, reference, path, conversation)
    finally:
        pipe.close()


def test_generate_with_a_formatted_prompt_and_a_video_part_equals_chat(family, clips):
    """generate() takes a video as its chat part beside the prompt's placeholder."""
    _, _, pipe, _ = family
    part = video_part(clips["mp4"], nframes=4)
    conversation = ask(part)
    text, _ = pipe.processor.render_chat(conversation, "test")
    assert "<|video_pad|>" in text
    ours = pipe.generate([text], [[part]], GREEDY_8)[0]
    assert ours.ok and ours.token_ids == pipe.chat(conversation, GREEDY_8)[0].token_ids
    bad = pipe.generate([text], [[{"type": "video", "video": clips["mp4"], "frames": 3}]], GREEDY_8)[0]
    assert not bad.ok and "prompt 0, item 0: unknown key 'frames'" in bad.error
