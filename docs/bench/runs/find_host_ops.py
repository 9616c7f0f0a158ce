"""The caption command, logging every aten op on the main thread that touches a CPU tensor of
>= 4096 elements once the first pack is encoded (where torch may fan out to OpenMP)."""
import atexit, collections, sys, traceback
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from mmpipe.engine import model_runner
from mmpipe.cli import main
hits = collections.Counter()
class Spy(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten((args, kwargs or {}, out))
        big = [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() >= 4096]
        if big and not getattr(func, "is_view", False) and "split" not in str(func) and "unbind" not in str(func):
            st = traceback.extract_stack(limit=10)[:-1]
            hits[(str(func), str(big[:3]), " < ".join(f"{f.filename.split('/')[-1]}:{f.name}:{f.lineno}" for f in reversed(st) if "eval_frame" not in f.filename and "_compile" not in f.filename))] += 1
        return out
orig = model_runner.ModelRunner.run_vision
state = {"on": False}
def run_vision(self, *a, **k):
    if not state["on"]:
        state["on"] = True
        Spy().__enter__()
    return orig(self, *a, **k)
model_runner.ModelRunner.run_vision = run_vision
def report():
    print(f"--- CPU ops >= 4096 elements after the first pack ({sum(hits.values())} calls)")
    for (f, shapes, where), n in hits.most_common(25):
        print(f"{n:6d} {f} {shapes}\n        {where}")
atexit.register(report)
try:
    main(sys.argv[1:])
except SystemExit:
    pass
report(); atexit.unregister(report)
