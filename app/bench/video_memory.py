"""Host memory of reading one long video the way the engine reads a chat's video: in a fresh
process, `mmpipe.video_loading.load_video` with the checkpoint's image processor config and its
family's `preprocess_video` (what `Pipeline.chat` runs on a preprocess worker), nothing else.
The child prints its resident set before the load (its imports: torch and mmpipe), after it
(holding the video's frame groups), and its high-water mark (`VmHWM`: the peak), as JSON.

    python -m mmpipe.app.bench.video_memory CHECKPOINT VIDEO FPS
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

GB = 1 << 30


def _status_bytes(key: str) -> int | None:
    """A `/proc/self/status` figure (VmRSS, VmHWM) in bytes; None where there is no /proc."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _peak_bytes() -> int:
    """This process's peak resident set: VmHWM, else getrusage's (kilobytes on Linux)."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(checkpoint: str, video: str, fps: float) -> dict[str, Any]:
    """In this process: load `video` and report memory, frames and grid."""
    from mmpipe.vision.preprocess import ImageProcessorConfig
    from mmpipe.vision.video_sampling import VideoOptions

    from mmpipe.models import spec_for
    from mmpipe.video_loading import load_video
    from mmpipe.video_parts import ChatVideo
    from mmpipe.video_reader import VideoFile

    with open(os.path.join(checkpoint, "config.json")) as handle:
        spec = spec_for(json.load(handle), checkpoint)
    cfg = ImageProcessorConfig.from_dir(checkpoint)
    with VideoFile(video) as file:
        info = file.info
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    loaded = load_video(ChatVideo(video, VideoOptions(fps=fps)), cfg, spec.preprocess_video)
    seconds = time.perf_counter() - start
    held = sum(group.pixels.numel() * group.pixels.element_size() for group in loaded.groups)
    height, width = loaded.groups[0].pixels.shape[1:3]
    return {"source_frames": info.total_frames, "source_size": [info.width, info.height], "source_fps": info.fps,
            "frames": len(loaded.frame_indices), "grid_thw": list(loaded.grid_thw), "tokens": loaded.num_tokens,
            "frame_size": [width, height], "load_s": seconds, "frames_bytes": held,
            "rss_before_bytes": before, "rss_after_bytes": _status_bytes("VmRSS"), "peak_rss_bytes": _peak_bytes()}


def long_video_memory(checkpoint: str, video: str, fps: float) -> dict[str, Any]:
    """`measure` in a fresh process; its figures under `long_video_*` keys."""
    proc = subprocess.run([sys.executable, "-m", "mmpipe.app.bench.video_memory", checkpoint, video, str(fps)],
                          capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"reading the long video in a child process failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    child = json.loads(lines[-1])
    out = {f"long_video_{key}": value for key, value in child.items()}
    out["long_video_path"] = video
    out["long_video_peak_rss_gb"] = child["peak_rss_bytes"] / GB
    if child["rss_before_bytes"] is not None:
        out["long_video_rss_before_gb"] = child["rss_before_bytes"] / GB
    out["long_video_frames_gb"] = child["frames_bytes"] / GB
    return out


def main(argv: list[str] | None = None) -> int:
    checkpoint, video, fps = argv if argv is not None else sys.argv[1:]
    print(json.dumps(measure(checkpoint, video, float(fps))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
