"""The systems `mmpipe bench decode` compares, each running a batch of token-id prompts for a
fixed number of new tokens: `transformers` `generate` (dynamic cache, or static cache with
torch.compile) and mmpipe's engine in a chosen graph mode; the prompts, the timed repeats, and what
is cleaned up between systems."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from typing import Any

import torch
from mmpipe.app.bench.decode_math import ms_per_step
from mmpipe.app.bench.timing import timed, wall_s

SYSTEMS = ("hf", "hf-static", "mmpipe-eager", "mmpipe-graphs")
LABELS = {"hf": "transformers (dynamic cache)",
          "hf-static": "transformers (static cache + compile)",
          "mmpipe-eager": "mmpipe eager",
          "mmpipe-graphs": "mmpipe graphs"}
GRAPH_MODES = {"mmpipe-eager": "none", "mmpipe-graphs": "full_and_piecewise"}


def gpus_of(system: str) -> int:
    """GPUs a system runs on: `mmpipe-graphs@tp2` and `mmpipe-graphs@ep2` two, a bare name one."""
    layout = system.partition("@")[2]
    return int(layout[2:]) if layout else 1


def label_of(system: str) -> str:
    name, _, layout = system.partition("@")
    if not layout:
        return LABELS.get(name, name)
    kind = "expert" if layout.startswith("ep") else "tensor"
    return f"{LABELS.get(name, name)}, {kind} parallel x{layout[2:]}"


def short(message: str, limit: int = 160) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def read_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as handle:
        return json.load(handle)


def make_prompts(path: str, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` random ordinary (non-special) token ids of the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(ordinary), (batch, length), generator=generator)
    return [[ordinary[int(i)] for i in row] for row in picks]


class HFSystem:
    """transformers `generate` on token ids, dynamic cache or static cache + torch.compile."""

    def __init__(self, model: Any, device: torch.device, static: bool, max_cache_len: int) -> None:
        self.model, self.device, self.static, self.max_cache_len = model, device, static, max_cache_len
        self.fullgraph = True
        self.note = ""

    def compile_config(self) -> Any:
        from transformers import CompileConfig

        if self.device.type == "cuda":
            return CompileConfig(fullgraph=self.fullgraph, mode="reduce-overhead")
        # CPU (tests): trace with dynamo but run eagerly, so the same generate path is exercised.
        config = CompileConfig(fullgraph=self.fullgraph, backend="eager", mode=None)
        config._compile_all_devices = True
        return config

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0, top_k=None, top_p=None, temperature=None)
        if self.static:
            # One cache length for every call, so N1 and N2 runs replay the same compiled graph and
            # attend over the same (masked) static cache.
            kwargs.update(cache_implementation="static", compile_config=self.compile_config(),
                          max_cache_len=self.max_cache_len)
        out = self.model.generate(**kwargs)  # generate runs under no_grad itself
        if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
            raise RuntimeError(f"transformers generated {tuple(out.shape)}, expected "
                               f"{(ids.shape[0], ids.shape[1] + new_tokens)}")

    def first_run(self, prompts: list[list[int]], new_tokens: int) -> None:
        """The warm-up; with compile, a fullgraph failure retries once with fullgraph=False."""
        try:
            self.run(prompts, new_tokens)
        except Exception as exc:  # dynamo/inductor raise many types
            if not (self.static and self.fullgraph):
                raise
            self.fullgraph = False
            self.note = f"fullgraph=False (fullgraph=True failed: {short(repr(exc), 100)})"
            print(f"  transformers static+compile: fullgraph=True failed ({short(repr(exc), 300)}); "
                  "retrying with fullgraph=False", file=sys.stderr)
            reset_compile()
            self.run(prompts, new_tokens)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.model.__dict__.pop("_compiled_call", None)
        self.model = None


class MmpipeSystem:
    """mmpipe's engine on token-id requests (text only), graph mode chosen."""

    def __init__(self, path: str, device: torch.device, dtype: str, graph_mode: str, num_kv_pages: int,
                 max_running_requests: int, quantization: str | None = None, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False) -> None:
        from mmpipe.app.bench.shapes import load_options

        from mmpipe import Pipeline

        options: dict[str, Any] = dict(num_kv_pages=num_kv_pages, max_running_requests=max_running_requests,
                                       graph_mode=graph_mode, prefix_caching=False,  # every run prefills
                                       quantization=quantization, tensor_parallel_size=tensor_parallel_size,
                                       expert_parallel=expert_parallel, **load_options(path))
        self.note = ""
        self.pipe, self.startup_s = timed(lambda: Pipeline.from_pretrained(path, device=str(device), dtype=dtype,
                                                                           **options), device)
        self.graph_mode = graph_mode

    def _requests(self, prompts: list[list[int]], params: Any) -> list[Any]:
        from mmpipe.engine.processor import Prepared

        pipe = self.pipe
        sampling = params.resolve(pipe.defaults)
        return [pipe.processor.assemble(Prepared(i, f"prompt {i}", list(ids), [], sampling, False), [])
                for i, ids in enumerate(prompts)]

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        from mmpipe import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)
        requests = self._requests(prompts, params)
        engine = self.pipe.engine
        with engine.lock:
            try:
                for request in requests:
                    engine.add(request)
                while any(not r.finished for r in requests):
                    engine.step()
            except BaseException:  # leave the engine empty for the next measurement
                for request in requests:
                    engine.abort(request)
                raise
        results = [(r.finish_reason, len(r.output_ids), r.error) for r in requests]
        bad = [r for r in results if r[0] != "length" or r[1] != new_tokens]
        if bad:
            raise RuntimeError(f"mmpipe: {len(bad)} request(s) did not generate {new_tokens} tokens "
                               f"(finish reason, tokens, error): {bad[:3]}")

    def first_run(self, prompts: list[list[int]], new_tokens: int) -> None:
        self.run(prompts, new_tokens)

    def stats(self) -> dict[str, Any]:
        return plain(self.pipe.stats())

    def preemptions(self) -> int | None:
        return self.pipe.engine.scheduler.preemptions

    def close(self) -> None:
        self.pipe.close()
        self.pipe = None


def plain(value: Any) -> Any:
    """A JSON-safe copy of a stats dict (dataclasses and enums turned into plain values)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def raise_recompile_limit(limit: int) -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))
            return


def reset_compile() -> None:
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    try:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except Exception:
        pass


def free_memory(device: torch.device) -> None:
    """Release what the last system left (never raises: it also runs after a failure)."""
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        except Exception as exc:  # a sticky CUDA error: the next system will report it too
            print(f"  freeing GPU memory failed: {exc!r}", file=sys.stderr)


def measure(system: Any, prompts: list[list[int]], n1: int, n2: int, repeats: int, device: torch.device,
            warm: bool) -> dict[str, Any]:
    """Warm up (unless `warm`), then `repeats` alternating runs of N1 and N2 new tokens."""
    first = None if warm else wall_s(lambda: system.first_run(prompts, n1), device)
    t1, t2 = [], []
    for _ in range(repeats):
        t1.append(wall_s(lambda: system.run(prompts, n1), device))
        t2.append(wall_s(lambda: system.run(prompts, n2), device))
    return {"t1_s": t1, "t2_s": t2, "first_call_s": first, "ms_per_step": ms_per_step(t1, t2, n1, n2)}
