"""cProfile of a second process's from_pretrained + first image request (caches filled)."""
import cProfile, pstats, sys, time
t0 = time.perf_counter()
from mmpipe import Pipeline, SamplingParams
print(f"import {time.perf_counter() - t0:.2f} s", flush=True)
conv = [{"role": "user", "content": [{"type": "image", "image": sys.argv[2]}, {"type": "text", "text": "Hi"}]}]
prof = cProfile.Profile()
t = time.perf_counter()
prof.enable()
pipe = Pipeline.from_pretrained(sys.argv[1], startup_progress=False)
out = pipe.chat([conv], SamplingParams(max_new_tokens=1))[0]
prof.disable()
print(f"to first token {time.perf_counter() - t:.2f} s; {pipe.startup_report()}", flush=True)
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats("triton", 40)
