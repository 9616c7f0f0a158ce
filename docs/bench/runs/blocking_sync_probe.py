"""Where a `HostTokens` waits behind a long kernel, with MMPIPE_BLOCKING_SYNC on and off: wall and
thread-CPU milliseconds of its construction and of `get()`, three rounds each after three
untimed ones, the flags alternating. Usage: python docs/bench/runs/blocking_sync_probe.py"""
import os, time
import torch
from mmpipe import settings
from mmpipe.language.sampler import HostTokens, SampleResult

tokens = torch.arange(7, device="cuda") * 3
for flag in ("1", "0", "1", "0"):
    os.environ["MMPIPE_BLOCKING_SYNC"] = flag
    settings.refresh()
    for _ in range(3):
        HostTokens(SampleResult(tokens, None, None, None), 5, logprobs=False).get()
    rows = []
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s
        c0, w0 = time.thread_time(), time.perf_counter()
        pending = HostTokens(SampleResult(tokens + 1, None, None, None), 5, logprobs=False)
        c1, w1 = time.thread_time(), time.perf_counter()
        ids, _ = pending.get()
        c2, w2 = time.thread_time(), time.perf_counter()
        assert ids == [[1], [4], [7], [10], [13]], ids
        rows.append(f"make {1e3 * (w1 - w0):.1f} ms wall / {1e3 * (c1 - c0):.1f} cpu, "
                    f"get {1e3 * (w2 - w1):.1f} wall / {1e3 * (c2 - c1):.1f} cpu")
    print(f"MMPIPE_BLOCKING_SYNC={flag}: " + " | ".join(rows), flush=True)
