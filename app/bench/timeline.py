"""Where a run's time goes, from a torch.profiler trace: GPU busy fraction, GPU time per engine
phase (ViT, prefill, decode), host-only gaps, host time per phase; and a PNG of it.

The engine marks its phases with `mmpipe.trace.phase` (`mmpipe.schedule`, `.vision`,
`.prefill`, `.decode`, `.read`, and `.wait` where the host blocks on the GPU). The profiler
projects those ranges onto the GPU timeline (`gpu_user_annotation`); a kernel belongs to the
phase whose projected range on its own stream holds it. Busy time is the union of kernel and
copy intervals, so overlapping kernels (the ViT on its own stream) are not counted twice.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from mmpipe.trace import PREFIX

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GPU_PHASES = ("vision", "prefill", "decode")
HOST_PHASES = ("schedule", "vision", "prefill", "decode", "read", "wait")
COLORS = {"vision": "#2a9d8f", "prefill": "#e9c46a", "decode": "#e76f51", "other": "#8d99ae",
          "schedule": "#457b9d", "read": "#6d597a", "wait": "#dddddd"}


@dataclass
class Interval:
    start: float  # microseconds, trace clock
    end: float
    name: str = ""
    kernel: str = ""  # for GPU intervals: the kernel's own name (`name` is its phase)
    lane: str = ""  # for GPU intervals: the stream (the trace's thread id) it ran on


@dataclass
class Timeline:
    """A run's trace, reduced to what the summary and the plot need."""

    start: float
    end: float
    kernels: list[Interval] = field(default_factory=list)  # name = phase ("other" if none)
    host: list[Interval] = field(default_factory=list)  # engine phases on the host, name = phase

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e6

    def summary(self) -> dict[str, float]:
        """Fractions of the run's wall time: GPU busy (any kernel), GPU busy per phase, host-only
        gaps; host seconds per phase (`wait`: blocked on the GPU)."""
        wall = max(self.end - self.start, 1e-9)
        out: dict[str, float] = {"seconds": self.seconds, "gpu_busy": union_length(self.kernels) / wall}
        for name in GPU_PHASES + ("other",):
            out[f"gpu_{name}"] = union_length([k for k in self.kernels if k.name == name]) / wall
        out["host_only_gaps"] = 1.0 - out["gpu_busy"]
        out.update(self.idle_split())
        for name in HOST_PHASES:
            out[f"host_{name}_s"] = sum(h.end - h.start for h in self.host if h.name == name) / 1e6
        out["kernels"] = float(len(self.kernels))
        return out

    def idle_split(self) -> dict[str, float]:
        """Idle GPU seconds by where they fall: before the first kernel (start-up: nothing
        encoded yet), after the last ViT or prefill kernel (the tail: only decoding is left),
        and in between."""
        busy = union_length(self.kernels)
        idle = (self.end - self.start - busy) / 1e6
        if not self.kernels:
            return {"idle_start_s": idle, "idle_middle_s": 0.0, "idle_tail_s": 0.0}
        first = min(k.start for k in self.kernels)
        feeding = [k.end for k in self.kernels if k.name in ("vision", "prefill")]
        last_feed = max(feeding) if feeding else first
        tail = [Interval(max(k.start, last_feed), k.end) for k in self.kernels if k.end > last_feed]
        idle_start = max(first - self.start, 0.0) / 1e6
        idle_tail = (self.end - last_feed - union_length(tail)) / 1e6
        return {"idle_start_s": idle_start, "idle_middle_s": max(idle - idle_start - idle_tail, 0.0),
                "idle_tail_s": idle_tail}

    def busy_profile(self, bins: int) -> dict[str, list[float]]:
        """Fraction of each of `bins` equal slices of the run that each phase's kernels cover."""
        width = max(self.end - self.start, 1e-9) / bins
        out = {name: [0.0] * bins for name in GPU_PHASES + ("other",)}
        for k in self.kernels:
            first = max(int((k.start - self.start) // width), 0)
            last = min(int((k.end - self.start) // width), bins - 1)
            for b in range(first, last + 1):
                lo, hi = self.start + b * width, self.start + (b + 1) * width
                out[k.name][b] += max(min(k.end, hi) - max(k.start, lo), 0.0) / width
        return {name: [min(v, 1.0) for v in values] for name, values in out.items()}

    def top_kernels(self, phase: str, count: int = 6) -> list[tuple[str, float, int]]:
        """The phase's kernels grouped by name, most GPU time first: (name, seconds, calls)."""
        totals: dict[str, list[float]] = {}
        for k in self.kernels:
            if k.name == phase:
                entry = totals.setdefault(k.kernel, [0.0, 0])
                entry[0] += (k.end - k.start) / 1e6
                entry[1] += 1
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
        return [(name, seconds, int(calls)) for name, (seconds, calls) in ranked]


def union_length(intervals: Iterable[Interval]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for iv in sorted(intervals, key=lambda i: i.start):
        if iv.end <= reach:
            continue
        total += iv.end - max(iv.start, reach)
        reach = iv.end
    return total


def from_trace_events(events: list[dict[str, Any]], run_range: str = PREFIX + "run") -> Timeline:
    """Build the timeline from chrome-trace events, limited to the host range `run_range` (the
    whole trace if there is none)."""
    def span(e: dict[str, Any]) -> Interval:
        start = float(e["ts"])
        return Interval(start, start + float(e.get("dur", 0.0)), e.get("name", ""), lane=str(e.get("tid", "")))

    complete = [e for e in events if e.get("ph") == "X"]
    runs = [span(e) for e in complete if e.get("cat") == "user_annotation" and e.get("name") == run_range]
    kernels = [span(e) for e in complete if e.get("cat") in GPU_CATEGORIES]
    if runs:
        lo, hi = min(r.start for r in runs), max(r.end for r in runs)
    elif kernels:
        lo, hi = min(k.start for k in kernels), max(k.end for k in kernels)
    else:
        raise ValueError("the trace has neither a run range nor GPU kernels")
    kernels = [k for k in kernels if k.end > lo and k.start < hi]
    gpu_ranges = sorted((span(e) for e in complete if e.get("cat") == "gpu_user_annotation"
                         and e.get("name", "").startswith(PREFIX)), key=lambda r: r.start)
    for kernel in kernels:
        kernel.kernel, kernel.name = kernel.name, phase_of(kernel, gpu_ranges)
    host = [Interval(h.start, h.end, h.name[len(PREFIX):]) for h in (
        span(e) for e in complete if e.get("cat") == "user_annotation" and e.get("name", "").startswith(PREFIX))
        if h.name[len(PREFIX):] in HOST_PHASES and h.end > lo and h.start < hi]
    return Timeline(lo, hi, kernels, host)


def phase_of(kernel: Interval, ranges: list[Interval]) -> str:
    """The GPU phase whose projected range holds the kernel (ranges sorted by start). The profiler
    projects a phase onto each stream its kernels ran on, so a range on the kernel's own stream
    decides; where none holds it (ranges without streams), or two do, the later-starting."""
    starts = [r.start for r in ranges]
    i = bisect.bisect_right(starts, kernel.start) - 1
    holding = [r for r in ranges[max(0, i - 16):i + 1][::-1]
               if r.start <= kernel.start and kernel.end <= r.end and r.name[len(PREFIX):] in GPU_PHASES]
    for r in [r for r in holding if r.lane == kernel.lane] or holding:
        return r.name[len(PREFIX):]
    return "other"


def load_trace(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def plot(timeline: Timeline, path: str, title: str, window_ms: float = 80.0) -> None:
    """Three panels: a zoomed window from the middle of the run (host phases above, GPU kernels by
    phase below); the whole run, GPU busy per phase over time (where the idle time falls); and
    one bar of the whole run's wall time split into GPU phases and idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = timeline.summary()
    fig, (ax, over_time, bar) = plt.subplots(3, 1, figsize=(12, 7.2), gridspec_kw={"height_ratios": [3, 2, 1]})
    mid = (timeline.start + timeline.end) / 2
    lo, hi = mid - window_ms * 500, mid + window_ms * 500
    lanes = {"host": 1.0, "GPU": 0.0}
    for lane, items in (("host", timeline.host), ("GPU", timeline.kernels)):
        for item in items:
            if item.end < lo or item.start > hi:
                continue
            ax.broken_barh([((item.start - lo) / 1000, max((item.end - item.start) / 1000, 0.004))],
                           (lanes[lane] - 0.35, 0.7), color=COLORS.get(item.name, "#999999"), linewidth=0)
    ax.set_yticks(list(lanes.values()), list(lanes.keys()))
    ax.set_xlim(0, (hi - lo) / 1000)
    ax.set_xlabel(f"ms (a {window_ms:.0f} ms window from the middle of the run)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[n]) for n in COLORS]
    ax.legend(handles, list(COLORS), ncol=len(COLORS), loc="upper center", bbox_to_anchor=(0.5, 1.22),
              fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10, pad=28)
    bins = 200
    profile = timeline.busy_profile(bins)
    xs = [(i + 0.5) * timeline.seconds / bins for i in range(bins)]
    names = list(GPU_PHASES) + ["other"]
    over_time.stackplot(xs, [profile[n] for n in names], colors=[COLORS[n] for n in names], linewidth=0)
    over_time.set_xlim(0, timeline.seconds)
    over_time.set_ylim(0, 1.05)
    over_time.set_ylabel("GPU busy")
    over_time.set_xlabel(f"s, whole run (idle: {summary['idle_start_s']:.2f} s before the first kernel, "
                         f"{summary['idle_middle_s']:.2f} s mid-run, {summary['idle_tail_s']:.2f} s in the "
                         "decode-only tail)")
    left = 0.0
    parts = [(n, summary[f"gpu_{n}"]) for n in GPU_PHASES + ("other",)]
    busy_sum = sum(v for _, v in parts)
    scale = summary["gpu_busy"] / busy_sum if busy_sum else 0.0  # phases may overlap (two streams)
    for name, width in [(n, v * scale) for n, v in parts] + [("idle", summary["host_only_gaps"])]:
        bar.barh(0, width, left=left, color=COLORS.get(name, "white"), edgecolor="black", linewidth=0.5)
        if width > 0.04:
            bar.text(left + width / 2, 0, f"{name}\n{width:.0%}", ha="center", va="center", fontsize=8)
        left += width
    bar.set_xlim(0, 1)
    bar.set_yticks([])
    bar.set_xlabel(f"whole run: {summary['seconds']:.2f} s, GPU busy {summary['gpu_busy']:.0%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
