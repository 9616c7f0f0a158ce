"""float32 decode of the tiny test checkpoint, eager, run twice with the rotary inside the decode
attention and twice without: the largest logprob difference between each pair of runs (is a
fused-vs-unfused difference larger than run-to-run?). Argument: the smallest fused bucket."""
import itertools
import os
import sys
import tempfile

from mmpipe import Pipeline, settings
from tests.gpu.test_gpu_decode_graphs import conversations, greedy
from tests.helpers import make_checkpoint

if len(sys.argv) > 1:  # the smallest fused bucket, e.g. 1 to fuse one-row steps too
    from mmpipe.language.attention import cuda_backend
    cuda_backend.ROPE_FUSED_FROM_ROWS = int(sys.argv[1])
path = make_checkpoint(tempfile.mkdtemp())
runs = {}
for fused, trial in itertools.product("10", "ab"):
    os.environ["MMPIPE_DECODE_ROPE_FUSED"] = fused
    settings.refresh()
    pipe = Pipeline.from_pretrained(path, device="cuda", dtype="float32", num_kv_pages=2048, graph_mode="none",
                                    max_running_requests=8)
    runs[fused + trial] = pipe.chat(conversations(5), greedy(5))
    pipe.close()
for a, b in itertools.combinations(runs, 2):
    tokens = [o.token_ids for o in runs[a]] == [o.token_ids for o in runs[b]]
    diff = max(abs(da[t] - db[t]) for x, y in zip(runs[a], runs[b]) for da, db in zip(x.logprobs, y.logprobs)
               for t in da if t in db)
    print(f"fused={a[0]} run {a[1]} vs fused={b[0]} run {b[1]}: tokens equal {tokens}, max logprob diff {diff:.3g}")
