"""Who imports torch._dynamo on the way to a first image request on the GPU (issue 29): prints
the stack of the first import, and the time of each phase. Usage: python dynamo_probe.py CKPT IMAGE"""
import builtins
import sys
import time
import traceback

original = builtins.__import__


def hook(name, *args, **kwargs):
    if name.startswith("torch._dynamo") and "torch._dynamo" not in sys.modules:
        print("first torch._dynamo import from:", flush=True)
        traceback.print_stack(limit=18, file=sys.stdout)
        start = time.perf_counter()
        try:
            return original(name, *args, **kwargs)
        finally:
            print(f"torch._dynamo import took {time.perf_counter() - start:.2f} s", flush=True)
    return original(name, *args, **kwargs)


builtins.__import__ = hook
from mmpipe import Pipeline, SamplingParams  # noqa: E402

start = time.perf_counter()
pipe = Pipeline.from_pretrained(sys.argv[1], startup_progress=False)
print(f"from_pretrained {time.perf_counter() - start:.2f} s: {pipe.startup_report()}", flush=True)
conversation = [{"role": "user", "content": [{"type": "image", "image": sys.argv[2]}, {"type": "text", "text": "Hi"}]}]
for k in range(2):
    start = time.perf_counter()
    out = pipe.chat([conversation], SamplingParams(max_new_tokens=1))[0]
    print(f"request {k + 1}: {time.perf_counter() - start:.2f} s ok={out.ok}", flush=True)
print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
pipe.close()
