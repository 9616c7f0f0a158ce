"""FP8 figures on the 3B shape (random weights), every configuration measured in one process:
bfloat16; `quantization="fp8"` and `"fp8-all"` (quantized at load); the same weights written as
published FP8 checkpoints (compressed-tensors per channel, block-wise 128x128) and loaded as such.

For each: LM weight bytes and the batch-1 floor (weight bytes / copy bandwidth), decode ms/step at
batch 1/8/32/128, time to first token at 256 and 1024 text tokens, ViT latency for one 448 and one
896 px image, and against bfloat16 over 64 prompts with a 448 px image: greedy agreement over 32
tokens and the mean KL(bf16 || q) of the first generated token's distribution.

    python docs/bench/fp8_figures.py CHECKPOINT_DIR WORK_DIR
    python docs/bench/fp8_figures.py bundled WORK_DIR   # the bundled model: accuracy only
    python docs/bench/fp8_figures.py CHECKPOINT_DIR WORK_DIR bf16,ckpt-block   # some configurations

With `bundled`: the 64 prompts are held-out scenes with the default caption prompt, and the
exact-caption rate of 64 greedy tokens is reported for each configuration.
"""
import json
import os
import shutil
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mmpipe import Pipeline, SamplingParams
from mmpipe.pipeline import caption_conversation
from tests.helpers import first_logits, random_image

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lm_linear(name: str) -> bool:
    return "visual" not in name and name.endswith(".weight") and any(f".{k}." in name for k in LINEARS)


def write_fp8(src: str, dst: str, fmt: str) -> str:
    """The checkpoint's language-model projections in a published FP8 format (quantized on the GPU)."""
    if os.path.isdir(dst):
        return dst
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for file in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        with safe_open(os.path.join(src, file), "pt", device="cuda") as handle:
            for name in handle.keys():
                w = handle.get_tensor(name)
                if not lm_linear(name):
                    tensors[name] = w.cpu()
                    continue
                w = w.float()
                if fmt == "channel":
                    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
                    tensors[name] = (w / scale).to(torch.float8_e4m3fn).cpu()
                    tensors[name + "_scale"] = scale.cpu()
                else:
                    n, k = w.shape
                    tiles = w.reshape(n // 128, 128, k // 128, 128)
                    scale = tiles.abs().amax((1, 3)).clamp(min=1e-12) / 448
                    tensors[name] = (tiles / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn).cpu()
                    tensors[name + "_scale_inv"] = scale.cpu()
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as handle:
        config = json.load(handle)
    if fmt == "channel":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                      "dynamic": False, "symmetric": True},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True, "symmetric": True}}},
            "ignore": ["lm_head", "re:.*visual.*"]}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    with open(os.path.join(dst, "config.json"), "w") as handle:
        json.dump(config, handle)
    return dst


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 10 * (1 << 30) / (time.perf_counter() - t)


def decode_ms(pipe: Pipeline, batch: int) -> float:
    prompts = ["hello there " * 8] * batch

    def run(n: int) -> float:
        t = time.perf_counter()
        pipe.generate(prompts, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0),
                      progress=False)
        return time.perf_counter() - t

    run(16)
    short, long = min(run(16) for _ in range(2)), min(run(144) for _ in range(2))
    return (long - short) / 128 * 1e3


def ttft_ms(pipe: Pipeline, tokens: int) -> float:
    prompt = "<|im_start|>user\n" + "a b " * (tokens // 2 - 8) + "<|im_end|>\n<|im_start|>assistant\n"
    one = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
    pipe.generate([prompt], sampling=one, progress=False)
    return min(pipe.generate([prompt], sampling=one, progress=False)[0].metrics.time_to_first_token_s
               for _ in range(5)) * 1e3


def vit_ms(pipe: Pipeline, side: int) -> float:
    image = pipe.processor.load_image(random_image(side, side, seed=side), "probe")
    for _ in range(3):
        pipe.runner.encode_images([image])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        pipe.runner.encode_images([image])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 20 * 1e3


def main() -> None:
    base, work = sys.argv[1], sys.argv[2]
    bundled = base == "bundled"
    if bundled:
        from mmpipe.app.tiny.scenes import score

        from mmpipe.pipeline import default_model_path

        base = default_model_path()
    configs = [("bf16", base, None), ("fp8", base, "fp8"), ("fp8-all", base, "fp8-all"),
               ("ckpt-channel", write_fp8(base, os.path.join(work, "fp8_channel"), "channel"), None),
               ("ckpt-block", write_fp8(base, os.path.join(work, "fp8_block"), "block"), None)]
    if len(sys.argv) > 3:  # a comma-separated subset of the configurations
        configs = [c for c in configs if c[0] in sys.argv[3].split(",")]
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    if bundled:
        from mmpipe.app.tiny.eval import TEST_SEED_BASE
        from mmpipe.app.tiny.scenes import make_scene

        scenes = [make_scene(s) for s in range(TEST_SEED_BASE, TEST_SEED_BASE + 64)]
        convs = [caption_conversation(scene.image) for scene in scenes]
        greedy = SamplingParams(max_new_tokens=64, temperature=0.0)
    else:
        convs = [caption_conversation(random_image(448, 448, seed=i), "Describe this image.") for i in range(64)]
        greedy = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.0)
    reference: dict[str, object] = {}
    for name, path, quantization in configs:
        t = time.perf_counter()
        pipe = Pipeline.from_pretrained(path, quantization=quantization, startup_progress=False)
        load = time.perf_counter() - t
        lm = pipe.model.language
        weight_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
        logits = torch.stack([first_logits(pipe, c).float() for c in convs])
        tokens = [o.token_ids for o in pipe.chat(convs, greedy, progress=False)]
        line = {"config": name, "quantization": pipe.model.quantization, "from_pretrained_s": round(load, 1),
                "lm_weight_gb": round(weight_bytes / 1e9, 2), "floor_ms": round(weight_bytes / bw * 1e3, 3)}
        if name == "bf16":
            reference = {"logits": logits, "tokens": tokens}
        else:
            p = torch.log_softmax(reference["logits"], -1)
            q = torch.log_softmax(logits, -1)
            line["mean_kl"] = float((p.exp() * (p - q)).sum(-1).mean())
            line["identical_sequences"] = sum(a == b for a, b in zip(reference["tokens"], tokens))
            line["first_token_equal"] = sum(a[:1] == b[:1] for a, b in zip(reference["tokens"], tokens))
            line["positionwise_agreement"] = round(sum(sum(x == y for x, y in zip(a, b)) for a, b in
                                                       zip(reference["tokens"], tokens)) /
                                                   sum(len(a) for a in reference["tokens"]), 3)
        if bundled:
            captions = [pipe.tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
            line["exact_captions"] = score(captions, [scene.caption for scene in scenes])["exact"]
            print(json.dumps(line), flush=True)
            pipe.close()
            continue
        for b in (1, 8, 32, 128):
            line[f"decode_ms_b{b}"] = round(decode_ms(pipe, b), 3)
        line["floor_share_b1"] = round(line["floor_ms"] / line["decode_ms_b1"], 3)
        for n in (256, 1024):
            line[f"ttft_ms_{n}"] = round(ttft_ms(pipe, n), 2)
        for side in (448, 896):
            line[f"vit_ms_{side}"] = round(vit_ms(pipe, side), 2)
        print(json.dumps(line), flush=True)
        pipe.close()
        del pipe
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
