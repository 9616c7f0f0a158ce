"""`mmpipe bench video` on the CPU: its flags parse, its files hold what their spec says (frame
count, size, rate, and frame i drawn as frame i, also across joined segments), the GPU busy
sampler degrades to "unavailable" without a driver, the long-video child reports its memory,
and the report renders a results dict."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from mmpipe.app.bench import gpu_busy
from mmpipe.app.bench.main import build_parser
from mmpipe.app.bench.video import report
from mmpipe.app.bench.video_clips import INDEX_BITS, ClipSpec, encode, join, write_clips

from mmpipe.video_reader import VideoFile


def test_the_parser_takes_every_documented_flag():
    args = build_parser().parse_args([
        "video", "--clips", "8", "--seconds", "2.5", "--source-fps", "24", "--size", "320x180", "--fps", "1.5",
        "--new-tokens", "16", "--prompt", "What happens?", "--hf-batch", "4", "--hf-clips", "4", "--skip-hf",
        "--long-minutes", "0.5", "--long-size", "640x360", "--long-fps", "25", "--skip-long", "--timeline", "t.png",
        "--timeline-clips", "4", "--engine", '{"max_running_requests": 64}', "--encode-workers", "2",
        "--checkpoint", "ckpt", "--workdir", "work", "--json", "out.json"])
    assert (args.clips, args.seconds, args.source_fps, args.size, args.fps) == (8, 2.5, 24.0, (320, 180), 1.5)
    assert (args.new_tokens, args.prompt, args.hf_batch, args.hf_clips) == (16, "What happens?", 4, 4)
    assert args.skip_hf
    assert (args.long_minutes, args.long_size, args.long_fps, args.skip_long) == (0.5, (640, 360), 25.0, True)
    assert (args.timeline, args.timeline_clips, args.encode_workers) == ("t.png", 4, 2)
    assert (args.checkpoint, args.workdir, args.json) == ("ckpt", "work", "out.json")
    defaults = build_parser().parse_args(["video"])
    assert (defaults.clips, defaults.seconds, defaults.source_fps, defaults.size, defaults.fps) == (64, 10.0, 30.0,
                                                                                                 (640, 360), 2.0)
    assert (defaults.new_tokens, defaults.hf_batch, defaults.hf_clips, defaults.long_minutes) == (64, 8, 16, 10.0)
    assert (defaults.long_size, defaults.long_fps, defaults.skip_hf, defaults.skip_long) == ((1920, 1080), 30.0,
                                                                                           False, False)


@pytest.mark.parametrize("size", ["640", "641x360", "axb", "8x8"])
def test_a_bad_size_is_a_usage_error(size):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["video", "--size", size])
    assert exit_.value.code == 2


def _index_of(frame: np.ndarray) -> int:
    """The frame index the top strip spells (one bit a block, read at the block's middle)."""
    width = frame.shape[1] // INDEX_BITS
    row = frame[2, :, :].astype(int).mean(axis=-1)
    return sum(1 << bit for bit in range(INDEX_BITS) if row[bit * width + width // 2] > 128)


def test_a_clip_has_the_asked_length_size_and_rate_and_is_written_once(tmp_path):
    spec = ClipSpec(1.0, 30.0, 64, 48)
    paths = write_clips(str(tmp_path), spec, [1, 2])
    for path in paths:
        with VideoFile(path) as video:
            assert (video.info.total_frames, video.info.width, video.info.height) == (30, 64, 48)
            assert video.info.fps == pytest.approx(30.0)
            assert video.info.duration == pytest.approx(1.0)
    with VideoFile(paths[0]) as a, VideoFile(paths[1]) as b:
        first, second, last = a.read([0, 1, 29], lambda f: f)
        other = b.read([0], lambda f: f)[0]
    assert not np.array_equal(first, second) and not np.array_equal(first, other)  # no two frames alike
    assert [_index_of(f) for f in (first, second, last)] == [0, 1, 29]
    stamp = os.path.getmtime(paths[0])
    assert write_clips(str(tmp_path), spec, [1, 2]) == paths and os.path.getmtime(paths[0]) == stamp


def test_joined_segments_are_one_file_with_every_frame_in_place(tmp_path):
    spec = ClipSpec(35 / 30, 30.0, 128, 48, preset="ultrafast", bframes=False)
    parts = [encode(str(tmp_path / "a.mp4"), spec, seed=5, first=0, count=20),
             encode(str(tmp_path / "b.mp4"), spec, seed=5, first=20, count=15)]
    path = join(parts, str(tmp_path / "joined.mp4"))
    with VideoFile(path) as video:
        assert video.info.total_frames == spec.frames == 35
        frames = video.read([0, 19, 20, 21, 34], lambda f: f)
    assert [_index_of(f) for f in frames] == [0, 19, 20, 21, 34]


def test_the_busy_sampler_without_a_driver_says_so(monkeypatch):
    for name in ("_nvml_reader", "_torch_reader", "_ctypes_reader"):
        monkeypatch.setattr(gpu_busy, name, lambda device, name=name: (None, f"{name} failed"))
    sampler = gpu_busy.BusySampler(device=0)
    with sampler:
        pass
    assert sampler.share is None and sampler.method.startswith("unavailable")
    monkeypatch.setattr(gpu_busy, "_nvml_reader", lambda device: (lambda: 40.0, "fake NVML"))
    with gpu_busy.BusySampler(device=0) as sampler:
        deadline = time.monotonic() + 30
        while sampler.samples < 2 and time.monotonic() < deadline:
            time.sleep(gpu_busy.POLL_S)
    assert sampler.share == pytest.approx(0.4) and "fake NVML" in sampler.describe()


def test_the_long_video_child_reports_its_memory_frames_and_grid(tmp_path):
    from mmpipe.app.bench.video_memory import long_video_memory

    from tests.helpers import make_checkpoint

    checkpoint = make_checkpoint(str(tmp_path / "ckpt"))
    path = encode(str(tmp_path / "long.mp4"), ClipSpec(4.0, 10.0, 96, 64, preset="ultrafast"), seed=3)
    out = long_video_memory(checkpoint, path, 2.0)
    assert out["long_video_source_frames"] == 40 and out["long_video_frames"] == 8
    assert out["long_video_grid_thw"][0] == 4 and out["long_video_tokens"] > 0
    assert out["long_video_peak_rss_gb"] >= out["long_video_rss_before_gb"] > 0


RESULT = {
    "gpu": "a GPU", "shape": "Qwen2.5-VL-3B", "clip_frames": 300, "clip_size": [640, 360], "clip_source_fps": 30.0,
    "sample_fps": 2.0, "new_tokens": 64, "frames_per_clip": 20, "frame_size": [644, 364],
    "video_grid_thw": [10, 26, 46], "video_tokens_per_clip": 2990,
    "mmpipe_clips": 64, "mmpipe_seconds": 8.0, "mmpipe_clips_per_s": 8.0, "mmpipe_output_tokens": 4096,
    "mmpipe_output_tokens_per_s": 512.0, "mmpipe_cpu_s_per_clip": 0.5, "mmpipe_gpu_busy": 0.81,
    "mmpipe_gpu_busy_method": "NVML utilization.gpu (pynvml)", "mmpipe_vit_captures_in_timed_run": 1,
    "mmpipe_timeline": {"seconds": 2.0, "gpu_busy": 0.9, "gpu_vision": 0.5, "gpu_prefill": 0.3,
                        "gpu_decode": 0.1, "gpu_other": 0.0},
    "hf_clips": 16, "hf_seconds": 16.0, "hf_clips_per_s": 1.0, "hf_output_tokens": 1024,
    "hf_output_tokens_per_s": 64.0, "hf_cpu_s_per_clip": 1.5, "hf_gpu_busy": 0.4,
    "hf_gpu_busy_method": "NVML utilization.gpu (pynvml)", "hf_batch": 8, "speedup": 8.0,
    "long_video_minutes": 10.0, "long_video_source_size": [1920, 1080], "long_video_source_frames": 18000,
    "long_video_frames": 768, "long_video_frame_size": [644, 336], "long_video_grid_thw": [384, 24, 46],
    "long_video_tokens": 105984, "long_video_load_s": 60.0, "long_video_peak_rss_gb": 1.5,
    "long_video_rss_before_gb": 0.5, "long_video_frames_gb": 0.5,
}


def test_the_report_renders_a_results_dict():
    text = report(RESULT)
    assert "| mmpipe Pipeline.chat | 64 | 8 | 8 | 512 | 0.5 | 81% | 8.0x |" in text
    assert "| transformers generate, batches of 8 | 16 | 16 | 1 | 64 | 1.5 | 40% | 1.0x |" in text
    assert "GPU busy: NVML utilization.gpu (pynvml)" in text and "captured 1 ViT graph" in text
    assert "one profiled pass" in text
    long_row = "| 10 min, 1920x1080, 18000 frames | 768 | 644x336 | [384, 24, 46] | 105984 | 60 | 1.5 | 0.5 | 0.5 |"
    assert long_row in text
    only_mmpipe = report({k: v for k, v in RESULT.items()
                          if not k.startswith(("hf_", "long_", "speedup", "mmpipe_timeline"))})
    assert "| mmpipe Pipeline.chat | 64 | 8 | 8 | 512 | 0.5 | 81% | - |" in only_mmpipe
    assert "transformers generate" not in only_mmpipe and "long video" not in only_mmpipe
    failed = report({**{k: v for k, v in RESULT.items() if not k.startswith(("hf_", "speedup"))},
                     "hf_error": "ImportError: no torchvision"})
    assert "transformers failed: ImportError: no torchvision" in failed and "| 1.5 | 0.5 | 0.5 |" in failed
