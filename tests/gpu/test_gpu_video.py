"""Video prompts on CUDA in every graph mode, against transformers (float32, every family):
one video, an image and a video, two videos (a file and a list of frames), and a video split
across prefill chunks (first-step logits within 5e-4 relative: prompts of near a thousand tokens
through different attention kernels; greedy tokens identical, logprobs within 1e-3); the ViT graph of a pack of frame groups equal to eager to the bit where
the pack fills its bucket exactly. Run on the GPU machine with `pytest -m gpu`."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from mmpipe import Pipeline
from tests.helpers import hf_model, make_checkpoint, random_image
from tests.parity_cases import assert_chunked_matches, assert_matches
from tests.video_helpers import make_video

pytestmark = pytest.mark.gpu

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
MODES = ["none", "piecewise", "full_decode_only", "full_and_piecewise"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_clips")
    return {"mp4": make_video(folder / "a.mp4", 45, 120, 90, fps=15),
            "mkv": make_video(folder / "b.mkv", 40, 97, 61, fps=Fraction(30000, 1001), codec="mjpeg")}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp(request.param)), family=request.param)
    return path, hf_model(path, device="cuda", dtype=torch.float32)


def conversations(clips) -> dict[str, list]:
    def ask(*parts):
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe this image."}]}]

    frames = [random_image(64, 48, seed=10 + k) for k in range(5)]
    return {
        "video": ask({"type": "video", "video": clips["mp4"]}),
        "image_and_video": ask({"type": "image", "image": random_image(150, 100, seed=2)},
                               {"type": "video", "video": clips["mkv"], "fps": 6, "min_pixels": 20000,
                                "max_pixels": 40000}),
        "two_videos": ask({"type": "video", "video": clips["mp4"], "nframes": 4, "video_start": 0.5},
                          {"type": "video", "video": frames, "sample_fps": 1.5}),
    }


@pytest.mark.parametrize("mode", MODES)
def test_float32_video_prompts_match_transformers_in_every_graph_mode(family, clips, mode):
    path, reference = family
    pipe = Pipeline.from_pretrained(path, device="cuda", dtype="float32", graph_mode=mode, num_kv_pages=4096)
    try:
        for conversation in conversations(clips).values():
            assert_matches(pipe, reference, path, conversation, device="cuda", logprob_tol=1e-3, logits_tol=5e-4)
    finally:
        pipe.close()


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_video_split_across_prefill_chunks_on_cuda(family, clips, mode):
    path, reference = family
    pipe = Pipeline.from_pretrained(path, device="cuda", dtype="float32", graph_mode=mode, num_kv_pages=4096,
                                    max_prefill_tokens=96)
    try:
        assert_chunked_matches(pipe, reference, path, conversations(clips)["video"], device="cuda",
                               logprob_tol=1e-3)
    finally:
        pipe.close()


def test_vit_graph_of_frame_groups_equals_eager_to_the_bit(tmp_path):
    """Frames of 112 x 112 are 64 patches a group; four groups fill the 256-patch bucket exactly.
    bfloat16: in float32 the ViT's attention has no graph-safe kernel and runs eagerly."""
    path = make_checkpoint(str(tmp_path / "ckpt"), family="qwen2_5_vl")
    clip = make_video(tmp_path / "c.mp4", 40, 120, 90, fps=10)
    part = {"type": "video", "video": clip, "nframes": 8, "resized_height": 112, "resized_width": 112}
    embeds = {}
    for mode in ("none", "full_and_piecewise"):
        pipe = Pipeline.from_pretrained(path, device="cuda", dtype="bfloat16", graph_mode=mode, num_kv_pages=1024)
        try:
            video = pipe.processor.load_image(_chat_video(part), "test")
            assert sum(group.num_patches for group in video.groups) == 256
            embeds[mode] = [e.clone() for e in pipe.runner.encode_images(video.groups)]
            if mode != "none":
                assert pipe.stats()["vit"]["graph_runs"] > 0, pipe.stats()["vit"]
        finally:
            pipe.close()
    assert all(torch.equal(a, b) for a, b in zip(embeds["none"], embeds["full_and_piecewise"]))


def _chat_video(part):
    from mmpipe.inputs import parse_conversation

    conversation = [{"role": "user", "content": [part, {"type": "text", "text": "x"}]}]
    return parse_conversation(conversation).images[0]
