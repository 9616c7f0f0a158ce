"""FP8 vs bfloat16 on the 3B shape (random weights): greedy agreement on 64 image prompts, decode
ms/step at batch 1/8/32/128, prefill time to first token at 256 and 1024 tokens.
Usage: python docs/bench/fp8_probe.py CKPT [decode-only]  (decode-only: no greedy agreement)"""
import sys, time, torch
from mmpipe import Pipeline, SamplingParams
from mmpipe.pipeline import caption_conversation
from tests.helpers import random_image
ck = sys.argv[1]
agreement = "decode-only" not in sys.argv[2:]
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): y.copy_(x)
torch.cuda.synchronize(); bw = 2 * 10 * (1 << 30) / (time.perf_counter() - t)
del x, y; torch.cuda.empty_cache()
print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
images = [random_image(448, 448, seed=i) for i in range(64)]
convs = [caption_conversation(im, "Describe this image.") for im in images]
greedy = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.0)
tokens = {}
for q in (None, "fp8"):
    name = q or "bf16"
    pipe = Pipeline.from_pretrained(ck, quantization=q, startup_progress=False)
    lm = pipe.model.language
    weight_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
    print(name, pipe.model.quantization, f"LM weights {weight_bytes / 1e9:.2f} GB, floor at batch 1 "
          f"{weight_bytes / bw * 1e3:.2f} ms")
    if agreement:
        tokens[name] = [o.token_ids for o in pipe.chat(convs, greedy, progress=False)]
    for b in (1, 8, 32, 128):
        prompts = ["hello there " * 8] * b
        def run(n):
            t = time.perf_counter()
            pipe.generate(prompts, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0), progress=False)
            return time.perf_counter() - t
        run(16); a = min(run(16) for _ in range(2)); c = min(run(144) for _ in range(2))
        ms = (c - a) / 128 * 1e3
        print(f"{name} decode batch {b}: {ms:.3f} ms/step" + (f" ({weight_bytes / bw * 1e3 / ms:.0%} of the floor)" if b == 1 else ""))
    for n in (256, 1024):
        prompt = "<|im_start|>user\n" + "a b " * (n // 2 - 8) + "<|im_end|>\n<|im_start|>assistant\n"
        one = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
        pipe.generate([prompt], sampling=one)
        outs = [pipe.generate([prompt], sampling=one)[0] for _ in range(5)]
        best = min(o.metrics.time_to_first_token_s for o in outs)
        print(f"{name} prefill {outs[0].num_prompt_tokens} tokens: TTFT {best * 1e3:.2f} ms")
    pipe.close()
    torch.cuda.empty_cache()
if agreement:
    same = sum(a == b for a, b in zip(tokens["bf16"], tokens["fp8"]))
    first = sum(a[:1] == b[:1] for a, b in zip(tokens["bf16"], tokens["fp8"]))
    agree = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(tokens["bf16"], tokens["fp8"])) / sum(len(a) for a in tokens["bf16"])
    print(f"64 image prompts, 32 greedy tokens: identical sequences {same}/64, first token equal {first}/64, "
          f"position-wise agreement {agree:.3f}")
