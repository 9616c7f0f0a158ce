"""Which Triton kernel specialisations a fresh machine compiles during `from_pretrained` and its
first image request, when, and how long each took (issue 29: the fresh-machine start-up), with
the graph runners' parallel-precompile passes timed. Runs with empty caches of its own.
Usage: python docs/bench/runs/triton_inventory.py CHECKPOINT [engine options as JSON]"""
import collections
import json
import os
import re
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-inventory-")
os.environ["MMPIPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mmpipe-cache-")
import triton  # noqa: E402

records: list[dict] = []
pending: dict = {}


def on_miss(**kwargs):
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or str(fn)
    pending[kwargs.get("key")] = (time.perf_counter(), name, str(kwargs.get("repr", ""))[:400])
    return False


def on_ready(**kwargs):
    got = pending.pop(kwargs.get("key"), None)
    if got is not None:
        start, name, spec = got
        now = time.perf_counter()
        records.append({"name": name, "seconds": now - start, "spec": spec, "start": start - T0, "end": now - T0})


triton.knobs.runtime.jit_cache_hook = on_miss
triton.knobs.runtime.jit_post_compile_hook = on_ready

from mmpipe import Pipeline  # noqa: E402
from mmpipe.graphs import runner as graph_runner  # noqa: E402

T0 = time.perf_counter()
marks: list[str] = []


def timed(cls, method):
    original = getattr(cls, method)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            end = time.perf_counter()
            marks.append(f"{start - T0:7.2f} -> {end - T0:7.2f} s  {self.name}.{method}")
    setattr(cls, method, wrapper)


timed(graph_runner.GraphRunner, "_precompile_if_cold")
timed(graph_runner.GraphRunner, "capture_all")

options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
t0 = time.perf_counter()
pipe = Pipeline.from_pretrained(sys.argv[1], startup_progress=False, **options)
print(f"from_pretrained {time.perf_counter() - t0:.1f} s")
print(pipe.startup_report())
ready = len(records)
from PIL import Image  # noqa: E402
import numpy as np  # noqa: E402

image = os.path.join(tempfile.mkdtemp(), "first.jpg")
rng = np.random.default_rng(0)
Image.fromarray(rng.integers(0, 255, (448, 448, 3), dtype=np.uint8)).save(image)
start = time.perf_counter()
out = pipe.chat([[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]],
                __import__("mmpipe").SamplingParams(max_new_tokens=1))[0]
print(f"first image request {time.perf_counter() - start:.2f} s (ok={out.ok}); "
      f"{len(records) - ready} specialisations during it")
print("timeline:")
for m in marks:
    print("  " + m)
for r in records:
    print(f"  {r['start']:7.2f} -> {r['end']:7.2f} s  {r['name']}")
by_name: dict = collections.defaultdict(list)
for r in records:
    by_name[r["name"]].append(r)
print(f"{len(records)} specialisations, {sum(r['seconds'] for r in records):.1f} s summed (wall from miss to ready)")
for name, rs in sorted(by_name.items(), key=lambda kv: -len(kv[1])):
    print(f"{len(rs):4d}  {sum(r['seconds'] for r in rs):6.1f} s  {name}")
    for r in rs[:40]:
        spec = re.sub(r"\s+", " ", r["spec"])
        print(f"        {r['seconds']:.2f} s  {spec[:300]}")
