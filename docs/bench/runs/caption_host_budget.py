"""Where the engine thread's time goes in a warm captioning run, per image: wall-clock seconds of
each host phase (timers wrapped around the engine's and the pipeline's methods; cheap enough to
leave the throughput as it is), how long `read` waits for the GPU, and, in a separate pass, the
GPU's busy fraction (CUDA-only profiler: the union of kernel intervals over the pass).
Usage: python docs/bench/runs/caption_host_budget.py CKPT N CONFIGS [BUSY_N]  (PASSES=2 timed passes per configuration)
  CONFIGS: comma-separated QUANT[:OPT[+OPT...]], QUANT bf16, fp8 or fp8-all; OPT inline (bca8980 only:
  EngineConfig.encode_ahead off), g8192 (prefill graphs also
  at 2560-8192 tokens in 512-token steps: the default since 8e30052), p2048 (max_prefill_tokens=2048),
  spin (MMPIPE_BLOCKING_SYNC=0: the engine spins while it waits for a step's tokens).
  BUSY_N=0 skips the traced pass; KERNELS=K prints the traced pass's K longest kernels (GPU ms per image)."""
import collections, functools, os, sys, tempfile, time, json
import torch
from mmpipe import Pipeline, SamplingParams, settings
from mmpipe.app.bench.caption import write_jpegs
from mmpipe.engine import batch, engine, model_runner, processor, scheduler
from mmpipe.config import GraphConfig
from mmpipe.language.prefill_graphs import STARTUP_PREFILL_SIZES
from mmpipe.pipeline import caption_conversation

ck, n = sys.argv[1], int(sys.argv[2])
configs = sys.argv[3].split(",")
busy_n = int(sys.argv[4]) if len(sys.argv) > 4 else 256
PASSES = int(os.environ.get("PASSES", "2"))
paths = write_jpegs(os.path.join(tempfile.mkdtemp(), "images"), n)
convs = [caption_conversation(p, "Describe this image.") for p in paths]
params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)
print(torch.cuda.get_device_name(), f"{n} files", flush=True)

seconds: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()



def timed(owner, name, label):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        if not main_thread():
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds[label] += time.perf_counter() - t
            calls[label] += 1
    setattr(owner, name, staticmethod(wrapper) if isinstance(owner.__dict__[name], staticmethod) else wrapper)


import threading
def main_thread():
    return threading.current_thread() is threading.main_thread()

for owner, name, label in [
        (engine.Engine, "step", "step"), (scheduler.Scheduler, "schedule", "schedule"),
        (engine.Engine, "_provide_images", "vision"), (model_runner.ModelRunner, "prefill", "prefill"),
        (model_runner.ModelRunner, "launch_sample", "sample"), (model_runner.ModelRunner, "launch_decode", "decode"),
        (engine.Engine, "_resolve", "read"), (batch.PendingDecode, "get", "read.wait"),
        (model_runner.ModelRunner, "apply_tokens", "read.apply"), (model_runner.ModelRunner, "release", "release"),
        (processor.InputProcessor, "prepare", "prepare"), (processor.InputProcessor, "render_chat", "render_chat"),
        (processor.InputProcessor, "assemble", "assemble")]:
    timed(owner, name, label)


def stream(pipe, count):
    pipe.engine.drain(); pipe.engine.cache.clear()
    torch.cuda.synchronize(); t = time.perf_counter()
    done = sum(1 for _ in pipe.chat_stream(iter(convs[:count]), params))
    torch.cuda.synchronize()
    assert done == count
    return time.perf_counter() - t


def busy(pipe, count):
    from torch.profiler import ProfilerActivity, profile
    pipe.engine.drain(); pipe.engine.cache.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        sum(1 for _ in pipe.chat_stream(iter(convs[:count]), params))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "t.json"))
        ev = json.load(open(os.path.join(tmp, "t.json")))["traceEvents"]
    ks = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in ev
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    total, end, gaps, last = 0.0, None, [], ""
    after = collections.Counter()
    for s, e, name in ks:
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
                if s - end > 50:  # which kernels end and begin the long gaps
                    after[(last[:28], name[:28])] += (s - end) / 1e6
            total += e - s; end = e; last = name
        elif e > end:
            total += e - end; end = e; last = name
    per_kernel = collections.Counter()
    for s, e, name in ks:
        per_kernel[name[:90]] += (e - s) / 1e3 / count  # ms per image
    kernels = "".join(f"\n    {v:7.3f} ms/image  {k}" for k, v in per_kernel.most_common(int(os.environ.get("KERNELS", "0"))))
    span = end - ks[0][0]  # the latest end (streams overlap), not the last-starting kernel's
    big = [g for g in gaps if g > 50]
    top = "; ".join(f"{a} -> {b}: {v:.3f} s" for (a, b), v in after.most_common(5))
    return (f"GPU busy {total / span:.1%} of the kernels' span {span / 1e6:.2f} s (pass wall {wall:.2f} s, "
            f"traced); gaps > 50 us: {len(big)} summing {sum(big) / 1e6:.3f} s; all gaps {sum(gaps) / 1e6:.3f} s"
            f"\n  longest gaps by kernels around them: {top}" + kernels)


for config in configs:
    quant, _, opts = config.partition(":")
    opts = set(filter(None, opts.split("+")))
    options = {"encode_ahead": False} if "inline" in opts else {}
    if "g8192" in opts:
        options["prefill_graph"] = GraphConfig(buckets=STARTUP_PREFILL_SIZES + tuple(range(2560, 8193, 512)))
    if "p2048" in opts:
        options["max_prefill_tokens"] = 2048
    os.environ["MMPIPE_BLOCKING_SYNC"] = "0" if "spin" in opts else "1"
    settings.refresh()
    with Pipeline.from_pretrained(ck, device="cuda", dtype="bfloat16", startup_progress=False,
                                  quantization=None if quant == "bf16" else quant, **options) as pipe:
        stream(pipe, min(64, n))
        stream(pipe, n)  # first pass: whatever is captured lazily
        seconds.clear(); calls.clear()
        cpu0 = time.process_time(); thread0 = time.thread_time()
        walls = [stream(pipe, n) for _ in range(PASSES)]
        cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        st = pipe.stats()
        m = PASSES * n
        print(f"{config} (encode_ahead {getattr(pipe.engine, 'encode_ahead', None)}): "
              f"{' / '.join(f'{n / w:.1f}' for w in walls)} images/s; process CPU {1e3 * cpu / m:.2f} ms/image, "
              f"main thread CPU {1e3 * thread / m:.2f} ms/image", flush=True)
        print("  main-thread wall ms/image:", {k: round(1e3 * v / m, 3) for k, v in seconds.most_common()})
        print("  calls:", dict(calls))
        r = st["runner"]
        print("  prefill graphs:", {k: st["prefill"][k] for k in ("graphs", "graph_runs", "eager_runs") if k in st["prefill"]},
              "warm-up retries", st["prefill"].get("detail", {}).get("warmup_retries"))
        print("  runner:", {k: r[k] for k in r if not isinstance(r[k], dict)})
        if busy_n:
            print("  " + busy(pipe, busy_n), flush=True)
        spy = os.environ.get("SPY")  # a py-spy binary: one more pass sampled, raw stacks to SPY_OUT
        if spy:
            import subprocess
            out = os.path.join(os.environ.get("SPY_OUT", "/tmp"), f"spy_{config}.txt")
            proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--rate", "250", "--format", "raw",
                                     "--nonblocking", "--threads", "--idle", "-o", out],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(2)
            wall = stream(pipe, n)
            proc.send_signal(2); _, err = proc.communicate(timeout=60)
            print(f"  py-spy pass {n / wall:.1f} images/s -> {out} ({err.decode()[-300:]!r})", flush=True)
