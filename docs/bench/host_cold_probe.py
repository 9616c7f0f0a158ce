"""Is host code slower right after a wait for the GPU? One fixed host workload timed after
different things: hot loop, GPU wait (spin), OS sleep, unrelated Python work, many launches."""
import os, statistics, time
import numpy as np
import torch
from mmpipe.language.mrope import mrope_positions
from mmpipe.runtime.transfer import to_device

OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p9.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()
dev = torch.device("cuda")
say("#", torch.cuda.get_device_name(), os.cpu_count(), "cpus")
ids = list(range(100, 164))
def pure():
    pos, d = mrope_positions(ids, [], 99999, 2)
    a = [np.asarray(ids, dtype=np.int64), pos.reshape(-1), np.arange(64, dtype=np.int64)]
    return np.concatenate(a)
arr = pure()
def cuda_work():
    return to_device(arr, dev)
x = torch.randn(64, 64, device=dev)
def before(kind):
    if kind == "hot":
        return
    if kind == "gpu_spin_sync":
        torch.cuda._sleep(int(2e6)); torch.cuda.synchronize()
    elif kind == "event_sync":
        torch.cuda._sleep(int(2e6)); e = torch.cuda.Event(); e.record(); e.synchronize()
    elif kind == "os_sleep_2ms":
        time.sleep(0.002)
    elif kind == "python_busy_2ms":
        t = time.perf_counter()
        d = {}
        while time.perf_counter() - t < 0.002:
            for i in range(200): d[i] = str(i)
    elif kind == "launches_1.5ms":
        torch.cuda._sleep(int(4e6))
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0015:
            torch.add(x, 1.0); x.mul(2.0)
        torch.cuda.synchronize()
for name, work in [("pure python+numpy", pure), ("to_device 2.5KB", cuda_work)]:
    for kind in ["hot", "gpu_spin_sync", "event_sync", "os_sleep_2ms", "python_busy_2ms", "launches_1.5ms", "hot"]:
        ts = []
        for i in range(120):
            before(kind)
            t = time.perf_counter(); work(); ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        say(f"| {name:20s} after {kind:16s} median {statistics.median(ts[20:])*1e6:7.1f} us  p10 {sorted(ts[20:])[10]*1e6:7.1f}")
