"""Device CPU times of the cold image path's host stages (PNG decode, resize, hash) on one 512 px noise PNG (issue 29).
Usage: python docs/bench/runs/prep_time.py (from the repository root)"""
import time, sys, io
sys.path.insert(0, '.')
from mmpipe.app.bench.ttft import write_pngs
from mmpipe.inputs import encoded_bytes, decode_encoded
from mmpipe.models import load_model
import mmpipe, os, hashlib
files = write_pngs('/tmp/pngs', 10, 512)
from mmpipe.pipeline import default_model_path
m = load_model(default_model_path(), __import__('torch').device('cpu'), __import__('torch').float32, "auto", "auto", None)
cfg = m.image_processor
print(cfg)
def t(f, n=10):
    s=time.perf_counter()
    for _ in range(n): r=f()
    return (time.perf_counter()-s)/n*1000, r
data = encoded_bytes(files[1])
print("bytes", len(data))
ms, img = t(lambda: decode_encoded(data, files[1])); print("decode ms", ms, img.size, img.mode)
ms, pre = t(lambda: m.spec.preprocess(decode_encoded(data, files[1]), cfg)); print("decode+preprocess ms", ms)
from PIL import Image
im = decode_encoded(data, files[1])
ms,_ = t(lambda: im.resize((504,504), Image.BICUBIC)); print("resize ms", ms)
ms,_ = t(lambda: hashlib.blake2b(data).digest()); print("hash file ms", ms)
from dataclasses import replace
cfg2 = replace(cfg, max_pixels=12845056)
ms, pre = t(lambda: m.spec.preprocess(decode_encoded(data, files[1]), cfg2)); print("decode+preprocess 504 ms", ms, type(pre))
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for f in files[:8]:
    m.spec.preprocess(decode_encoded(encoded_bytes(f), f), cfg2)
pr.disable(); pstats.Stats(pr).sort_stats('tottime').print_stats(12)
