"""A video's patches, grid, `second_per_grid_ts` and prompt tokens against transformers'
processors of each family, fed what Qwen's `qwen_vl_utils` samples (its frames, sample rate and
metadata, with `do_resize=False`, as Qwen's model cards call them). transformers' video processors
need torchvision, which has no CPU build to install here: these run where it imports (the GPU
machine: `pytest -m gpu` also collects them). On CUDA, the patchify kernel on a pack mixing
images and frame groups equals the host arithmetic to the bit."""

from __future__ import annotations

import pytest
import torch

from mmpipe import Pipeline
from mmpipe.inputs import parse_conversation
from tests.helpers import cuda_available, make_checkpoint, random_image
from tests.qwen_oracle import fetch_video, real_torchvision
from tests.video_helpers import make_video

needs_torchvision = pytest.mark.skipif(not real_torchvision(),
                                       reason="transformers' video processors need torchvision (none for this CPU)")
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("pre") / "clip.mp4", 50, 130, 94, fps=24)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = make_checkpoint(str(tmp_path_factory.mktemp(request.param)), family=request.param)
    pipe = Pipeline.from_pretrained(path, device="cpu")
    yield request.param, path, pipe
    pipe.close()


def hf_processor(name: str, path: str):
    """transformers' processor of the family, from its own classes and the checkpoint's configs."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    common = {"patch_size": image_processor.patch_size, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": image_processor.image_mean, "image_std": image_processor.image_std}
    if name == "qwen3_vl":
        from transformers import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLProcessor(image_processor, tokenizer, Qwen3VLVideoProcessor(**common),
                                chat_template=tokenizer.chat_template)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    cls = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[name]
    import transformers

    return getattr(transformers, cls)(image_processor, tokenizer, Qwen2VLVideoProcessor(**common),
                                      chat_template=tokenizer.chat_template)


@needs_torchvision
@pytest.mark.parametrize("keys", [{}, {"fps": 5.0, "min_pixels": 20000, "max_pixels": 40000},
                                  {"nframes": 6, "video_start": 0.4}])
def test_patches_grid_seconds_and_prompt_tokens_equal_transformers(family, clip, keys):
    name, path, pipe = family
    patch = pipe.model.image_processor.patch_size
    frames, metadata, sample_fps = fetch_video({"type": "video", "video": clip, **keys}, patch)
    processor = hf_processor(name, path)
    conversation = [{"role": "user", "content": [{"type": "image", "image": random_image(224, 224, seed=3)},
                                                 {"type": "video", "video": clip, **keys},
                                                 {"type": "text", "text": "Describe this image."}]}]
    text, _ = pipe.processor.render_chat(conversation, "test")
    # Qwen's model cards hand qwen_vl_utils' metadata over; do_resize=False reaches the image
    # too, so the image is one both families take as it is (224 = 8 x 28 = 7 x 32) (the sample rate is its sampled_fps)
    reference = processor(text=[text], images=[conversation[0]["content"][0]["image"]], videos=[frames],
                          video_metadata=[metadata], do_resize=False, do_sample_frames=False, return_tensors="pt")
    assert abs(sample_fps - len(metadata["frames_indices"]) / metadata["total_num_frames"] * metadata["fps"]) < 1e-9
    request = pipe.processor.build(0, text, parse_conversation(conversation).images, _params(), "test")
    video = pipe.processor.load_image(parse_conversation(conversation).images[1], "test")
    ours = torch.cat([group.pixel_values for group in video.groups])
    assert torch.equal(ours, reference["pixel_values_videos"])
    assert list(video.grid_thw) == reference["video_grid_thw"][0].tolist()
    if name == "qwen2_5_vl":
        assert torch.tensor(video.seconds_per_group) == reference["second_per_grid_ts"][0]
    assert request.prompt_ids == reference["input_ids"][0].tolist()


def _params():
    from mmpipe import SamplingParams

    return SamplingParams(max_new_tokens=1)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_the_patchify_kernel_on_images_and_frame_groups_equals_the_host(clip):
    from mmpipe.vision.preprocess import ImageProcessorConfig, patches_on_device, preprocess_image
    from mmpipe.vision.video_frames import build_video
    from mmpipe.vision.video_sampling import VideoOptions

    from mmpipe.video_loading import load_video
    from mmpipe.video_parts import ChatVideo

    cfg = ImageProcessorConfig()
    video = load_video(ChatVideo(clip, VideoOptions(fps=6.0)), cfg, build_video)
    images = [preprocess_image(random_image(100 + 30 * k, 80, seed=k), cfg) for k in range(2)]
    pack = [images[0], *video.groups[:3], images[1], *video.groups[3:]]
    on_gpu = patches_on_device(pack, torch.device("cuda"))
    assert torch.equal(on_gpu.cpu(), torch.cat([item.pixel_values for item in pack]))
