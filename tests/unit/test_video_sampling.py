"""Which frames of a video mmpipe samples and at what size, against Qwen's `qwen_vl_utils`
(tests/qwen_oracle.py): frame indices, the file's frame rate, the sample rate and the frame size
for files of several codecs, containers, rates and sizes under every sampling and sizing key,
for patch sizes 14 and 16; the resized frames themselves; lists of frames; the rules' edge cases
and their errors; and the key checks of a video part."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from mmpipe.vision.preprocess import ImageProcessorConfig
from mmpipe.vision.video_frames import build_video
from mmpipe.vision.video_sampling import VideoOptions, frame_count, frame_range

from mmpipe.errors import InputError, VideoLoadError
from mmpipe.inputs import parse_conversation
from mmpipe.video_loading import load_video, video_frames_tensor
from mmpipe.video_parts import ChatVideo
from tests.helpers import random_image
from tests.qwen_oracle import fetch_video, vision_process
from tests.video_helpers import make_video

OPTIONS = [
    {},
    {"fps": 4.0},
    {"nframes": 6},
    {"nframes": 5},  # rounds to an even count
    {"fps": 1.0, "min_frames": 6},
    {"max_frames": 4},
    {"video_start": 0.5, "video_end": 2.0},
    {"video_start": 1.0},
    {"video_end": 1.3, "fps": 3.0},
    {"min_pixels": 20000, "max_pixels": 40000},
    {"total_pixels": 300000},
    {"min_pixels": 3000, "total_pixels": 30000},  # the total budget binds: frames shrink
    {"max_pixels": 150000},
    {"max_pixels": 90000},  # under a frame's default least (128 tokens): both refuse
    {"resized_height": 100, "resized_width": 150},
]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampling")
    return {
        "h264_mp4_24fps": make_video(folder / "a.mp4", 72, 160, 96, fps=24),
        "mpeg4_avi_25fps": make_video(folder / "b.avi", 60, 128, 72, fps=25, codec="mpeg4"),
        "vp9_webm_2997fps": make_video(folder / "c.webm", 80, 96, 64, fps=Fraction(30000, 1001), codec="libvpx-vp9"),
        "mjpeg_mkv_odd_size": make_video(folder / "d.mkv", 50, 97, 61, fps=20, codec="mjpeg"),
    }


def ours(source, keys: dict, patch: int):
    cfg = ImageProcessorConfig(patch_size=patch)
    return load_video(ChatVideo(source, VideoOptions(**keys)), cfg, build_video)


@pytest.mark.parametrize("patch", [14, 16])
@pytest.mark.parametrize("clip", ["h264_mp4_24fps", "mpeg4_avi_25fps", "vp9_webm_2997fps", "mjpeg_mkv_odd_size"])
def test_frames_rates_and_sizes_equal_qwen_vl_utils(clips, clip, patch):
    refused = 0
    for keys in OPTIONS:
        try:
            video, metadata, sample_fps = fetch_video({"type": "video", "video": clips[clip], **keys}, patch)
        except (ValueError, AssertionError):
            with pytest.raises(InputError):
                ours(clips[clip], keys, patch)
            refused += 1
            continue
        got = ours(clips[clip], keys, patch)
        frames = video_frames_tensor(got)
        assert got.frame_indices == [int(i) for i in metadata["frames_indices"]], keys
        assert got.video_fps == pytest.approx(metadata["fps"], rel=1e-12), keys
        assert got.sample_fps == pytest.approx(sample_fps, rel=1e-12), keys
        assert tuple(frames.shape) == (video.shape[0], video.shape[2], video.shape[3], 3), keys
        assert got.grid_thw == (video.shape[0] // 2, video.shape[2] // patch, video.shape[3] // patch)
    assert refused <= 2


def test_the_resized_frames_equal_qwen_vl_utils(clips):
    for clip, keys in [("h264_mp4_24fps", {}), ("mjpeg_mkv_odd_size", {"min_pixels": 20000, "max_pixels": 40000}),
                       ("vp9_webm_2997fps", {"resized_height": 100, "resized_width": 150})]:
        video, _, _ = fetch_video({"type": "video", "video": clips[clip], **keys}, 14)
        frames = video_frames_tensor(ours(clips[clip], keys, 14))
        assert torch.equal(frames, video.round().to(torch.uint8).permute(0, 2, 3, 1)), (clip, keys)


@pytest.mark.parametrize("keys", [{}, {"min_pixels": 30000, "max_pixels": 60000}, {"sample_fps": 3.0},
                                  {"resized_height": 90, "resized_width": 120}, {"total_pixels": 100000}])
def test_a_list_of_frames_equals_qwen_vl_utils(keys):
    frames = [random_image(150, 100, seed=k) for k in range(7)]  # padded to 8 with its last frame
    video, metadata, sample_fps = fetch_video({"type": "video", "video": frames, **keys}, 14)
    got = ours(frames, keys, 14)
    assert got.frame_indices == list(metadata["frames_indices"]) == list(range(8))
    assert got.video_fps == metadata["fps"] and got.sample_fps == sample_fps
    assert torch.equal(video_frames_tensor(got), video.round().to(torch.uint8).permute(0, 2, 3, 1))


def test_frame_counts_and_ranges_equal_the_helpers_rules_everywhere():
    vp = vision_process()
    keys_grid = [{}, {"fps": 0.5}, {"fps": 3.0}, {"nframes": 3}, {"nframes": 8}, {"min_frames": 7},
                 {"max_frames": 9}, {"fps": 5.0, "min_frames": 2, "max_frames": 6}]
    ranges = [{}, {"video_start": 0.2}, {"video_end": 2.7}, {"video_start": 0.9, "video_end": 1.1},
              {"video_start": 50.0}, {"video_start": 1.0, "video_end": 0.95 + 1.0}]
    checked = 0
    for total, fps, keys, cut in itertools.product([1, 3, 4, 9, 60, 2000], [1.0, 23.976, 30.0, 60.0], keys_grid,
                                                   ranges):
        element = {**keys, **cut}
        try:
            first, last, count = vp.calculate_video_frame_range(element, total, fps)
            expected = vp.smart_nframes(element, total_frames=count, video_fps=fps)
        except (ValueError, AssertionError):
            with pytest.raises(InputError):
                options = VideoOptions(**element)
                first, last, count = frame_range(options, total, fps)
                frame_count(options, count, fps)
            continue
        options = VideoOptions(**element)
        assert frame_range(options, total, fps) == (first, last, count), (total, fps, element)
        assert frame_count(options, count, fps) == expected, (total, fps, element)
        checked += 1
    assert checked > 300


def test_a_clip_shorter_than_four_frames_worth(tmp_path):
    """3 frames: qwen_vl_utils takes 2 (the most an even count allows); 1 frame: none, an error."""
    three = make_video(tmp_path / "three.mp4", 3, 64, 48, fps=3)
    video, metadata, _ = fetch_video({"type": "video", "video": three}, 14)
    got = ours(three, {}, 14)
    assert got.frame_indices == list(metadata["frames_indices"]) and video.shape[0] == 2
    one = make_video(tmp_path / "one.mp4", 1, 64, 48, fps=3)
    with pytest.raises(ValueError):
        vision_process().smart_nframes({}, total_frames=1, video_fps=3.0)
    with pytest.raises(VideoLoadError, match=r"one\.mp4.*1 frames"):
        ours(one, {}, 14)


def test_video_start_past_the_end_is_an_error_naming_the_file(clips):
    with pytest.raises(VideoLoadError, match=r"a\.mp4.*video_start=10"):
        ours(clips["h264_mp4_24fps"], {"video_start": 10.0}, 14)
    with pytest.raises(VideoLoadError, match=r"a\.mp4.*nframes=400"):
        ours(clips["h264_mp4_24fps"], {"nframes": 400}, 14)


@pytest.mark.parametrize("part, message", [
    ({"video": "x.mp4", "fps": 2, "nframes": 4}, "fps or nframes, not both"),
    ({"video": "x.mp4", "resized_height": 100}, "resized_height and resized_width go together"),
    ({"video": "x.mp4", "frames": 4}, "unknown key 'frames' in a video part; accepted: 'type', 'video', 'fps'"),
    ({"video": "x.mp4", "fps": -1}, "fps must be positive"),
    ({"video": "x.mp4", "nframes": 2.5}, "nframes must be a positive whole number"),
    ({"video": "x.mp4", "min_frames": 8, "max_frames": 4}, "min_frames=8 is above max_frames=4"),
    ({"video": "x.mp4", "video_start": 3, "video_end": 2}, "video_start=3.0 is not before video_end=2.0"),
    ({"video": "x.mp4", "sample_fps": 2}, "sample_fps describes a list of frames"),
    ({"video": ["a.png"], "fps": 2}, "fps sample a video file; a list of frames is taken whole"),
    ({"video": []}, "list of frames is empty"),
    ({"video": [3]}, "frame 0 is a int"),
    ({"video": 3}, "'video' must be a path"),
    ({}, "a video part needs 'video'"),
])
def test_a_video_part_with_bad_keys_is_refused_by_name(part, message):
    conversation = [{"role": "user", "content": [{"type": "video", **part}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(InputError, match="message 0, part 0: .*" + message.replace("(", r"\(")):
        parse_conversation(conversation)


def test_video_parts_and_video_url_parts_parse_in_order():
    conversation = [{"role": "user", "content": [
        {"type": "image", "image": "a.png"}, {"type": "video", "video": "file:///v%20a.mp4", "fps": 1, "max_frames": 8},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, {"type": "text", "text": "hi"}]}]
    parsed = parse_conversation(conversation)
    kinds = [type(item).__name__ for item in parsed.images]
    assert kinds == ["ChatImage", "ChatVideo", "ChatVideo"]
    assert parsed.images[1].options == VideoOptions(fps=1.0, max_frames=8)
    assert parsed.images[2].source == "data:video/mp4;base64,AAAA"
    assert [p["type"] for p in parsed.template_messages[0]["content"]] == ["image", "video", "video", "text"]


def test_a_numpy_frame_list_and_its_pil_twin_give_the_same_video():
    frames = [random_image(90, 70, seed=k) for k in range(4)]
    a = video_frames_tensor(ours(frames, {}, 14))
    b = video_frames_tensor(ours([np.asarray(f) for f in frames], {}, 14))
    assert torch.equal(a, b)
