"""How each piece of a piecewise forward is compiled, and the disk cache of compiled pieces.

Two piece compilers: `eager` takes the traced piece as it is (nothing to compile, fast start;
its Triton kernel nodes launched directly), `inductor` compiles each distinct piece once for the
dynamic size through `standalone_compile`. Inductor's artifacts are saved under
`<cache dir>/inductor-<environment key>/<piece key>`: the environment key hashes what compiled code
depends on (torch, Triton, the GPU, the model and the compiler settings), the piece key the
piece's graph with its nodes named by position, so a second start loads instead of compiling and
structurally equal pieces of different layers compile once. A write goes to a temporary name and
is renamed into place, so a reader never sees half an artifact; one it cannot load is compiled
again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import fx

from mmpipe import settings
from mmpipe.graphs.fx_passes import launch_triton_directly
from mmpipe.kernels import triton

log = logging.getLogger("mmpipe")

__all__ = ["COMPILERS", "InductorCompiler", "PieceCompiler", "default_cache_dir", "environment_key",
           "make_piece_compiler"]

COMPILERS = ("eager", "inductor")


def environment_key(extra: dict[str, Any]) -> str:
    """A hash of what compiled code depends on: torch and Triton versions, the GPU, and `extra`
    (the model config, the compiler and its settings)."""
    parts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, **extra}
    parts["triton"] = triton.__version__ if triton is not None else None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        parts["gpu"] = [props.name, props.major, props.minor]
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """`$MMPIPE_CACHE_DIR`, else `$XDG_CACHE_HOME/mmpipe`, else `~/.cache/mmpipe` (`mmpipe.settings`)."""
    return settings.current().cache_dir


def _canonical_code(module: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The piece's graph with every node named by its position, plus its inputs' dtypes and shapes:
    equal for the same piece of different layers (whose node names differ)."""
    index = {node: i for i, node in enumerate(module.graph.nodes)}

    def arg(value: Any) -> str:
        return repr(fx.node.map_arg(value, lambda n: f"%{index[n]}"))

    def target(node: fx.Node) -> str:
        return "" if node.op == "placeholder" else str(getattr(node.target, "__name__", node.target))

    def kwargs(node: fx.Node) -> str:
        values = dict(node.kwargs)
        if "kernel_idx" in values:  # a user Triton kernel: side-table indices differ per trace
            from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

            kernel = kernel_side_table.get_kernel(values.pop("kernel_idx"))
            values["kernel"] = getattr(getattr(kernel, "fn", kernel), "__qualname__", repr(kernel))
            if "constant_args_idx" in values:
                values["constants"] = repr(kernel_side_table.get_constant_args(values.pop("constant_args_idx")))
        return arg(values)

    lines = [f"{node.op} {target(node)} {arg(node.args)} {kwargs(node)}" for node in module.graph.nodes]
    meta = [(str(x.dtype), [str(s) for s in x.shape], [str(s) for s in x.stride()]) if isinstance(x, torch.Tensor)
            else type(x).__name__ for x in example_inputs]
    text = "\n".join(lines) + json.dumps(meta)
    symbols: dict[str, str] = {}  # the tracer numbers size symbols per trace: rename by first use
    return re.sub(r"\bs\d+\b", lambda m: symbols.setdefault(m.group(0), f"s{len(symbols)}"), text)


class PieceCompiler:
    """`eager`: the traced piece as it is."""

    name = "eager"

    def __init__(self) -> None:
        self.compilations = 0
        self.cache_hits = 0
        self.direct_triton_launches = 0

    def compile(self, module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.direct_triton_launches += launch_triton_directly(module)
        return module


class InductorCompiler(PieceCompiler):
    """Inductor, once per distinct piece for the dynamic size, through `standalone_compile`;
    artifacts saved under `cache_dir/<environment key>/` and loaded on later starts."""

    name = "inductor"

    def __init__(self, cache_dir: Path | None, env_key: str) -> None:
        super().__init__()
        self.dir = None if cache_dir is None else Path(cache_dir) / f"inductor-{env_key}"
        self.memo: dict[str, Callable[..., Any]] = {}
        self.loads = 0

    def compile(self, module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor import CompiledArtifact, standalone_compile

        key = hashlib.sha256(_canonical_code(module, example_inputs).encode()).hexdigest()[:24]
        if key in self.memo:  # the same piece in another layer
            self.cache_hits += 1
            return self.memo[key]
        path = None if self.dir is None else self.dir / key
        compiled = None
        if path is not None and path.exists():
            try:
                compiled = CompiledArtifact.load(path=str(path), format="unpacked")
                self.loads += 1
            except Exception as exc:  # a partial write or a format change: compile again
                log.warning("compile cache entry %s unreadable (%s); compiling", path, exc)
        if compiled is None:
            compiled = standalone_compile(module, list(example_inputs), dynamic_shapes="from_tracing_context")
            self.compilations += 1
            if path is not None:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
                    compiled.save(path=str(tmp), format="unpacked")
                    os.replace(tmp, path)
                except OSError as exc:
                    log.warning("could not write the compile cache at %s (%s)", path, exc)
        compiled = _same_output_structure(module, compiled)
        self.memo[key] = compiled
        return compiled


def _same_output_structure(module: fx.GraphModule, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A compiled artifact may return its outputs as a flat list (loaded ones do); the stitching
    module expects what the piece returned: one value, or a tuple."""
    output = next(n for n in module.graph.nodes if n.op == "output").args[0]
    single = not isinstance(output, (tuple, list))

    def call(*args: Any) -> Any:
        result = compiled(*args)
        if isinstance(result, (tuple, list)):
            return result[0] if single else tuple(result)
        return result

    return call


def make_piece_compiler(name: str, cache_dir: Path | None, env_key: str) -> PieceCompiler:
    if name == "eager":
        return PieceCompiler()
    if name == "inductor":
        return InductorCompiler(cache_dir, env_key)
    raise ValueError(f"piece compiler {name!r}: use one of {', '.join(COMPILERS)}")
