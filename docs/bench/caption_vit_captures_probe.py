"""Captioning: ViT graph stats per pass (captures as new pack sizes appear) and a cProfile of one pass (engine thread). $OUT/p19.txt"""
import os, time, json, cProfile, pstats, io
import torch
from mmpipe.app.bench import build_3b_checkpoint
from mmpipe.app.bench_caption import write_jpegs
from mmpipe import Pipeline, SamplingParams
from mmpipe.pipeline import caption_conversation
OUT = os.environ.get("OUT", "/tmp")
log = open(OUT + "/p19.txt", "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()
say("#", torch.cuda.get_device_name())
ck = build_3b_checkpoint("/tmp/ck3b")
paths = write_jpegs("/tmp/capimgs", 256)
params = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)
with Pipeline.from_pretrained(ck, device="cuda", dtype="bfloat16") as pipe:
    convs = [caption_conversation(p, "Describe this image.") for p in paths]
    eng = pipe.engine
    def vit():
        v = pipe.stats()["vit"]; return {k: v[k] for k in v if not isinstance(v[k], (list, dict))}
    def stream(n):
        eng.drain(); eng.cache.clear(); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in pipe.chat_stream(iter(convs[:n]), params): pass
        torch.cuda.synchronize(); return time.perf_counter() - t
    say("after start", vit())
    for n in (64, 64, 256, 256, 256, 256):
        s = stream(n); say(f"{n} files: {s:.3f} s, {n/s:.1f} img/s", vit())
    pr = cProfile.Profile(); eng.drain(); eng.cache.clear(); torch.cuda.synchronize()
    t = time.perf_counter(); pr.enable()
    for _ in pipe.chat_stream(iter(convs), params): pass
    torch.cuda.synchronize(); pr.disable(); say(f"cProfiled pass {time.perf_counter() - t:.3f} s")
    buf = io.StringIO(); pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45); say(buf.getvalue())
    buf = io.StringIO(); pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25); say(buf.getvalue())
