"""Piecewise CUDA graphs: a `torch.compile` backend that splits a traced forward at chosen ops and
turns every piece between them into a per-size CUDA graph (the design of SGLang's and vLLM's
piecewise runners, from `shared/seeds/000` and `003`).

`torch.compile(forward, backend=PiecewiseBackend(...))`, with the token dimension of the inputs
marked dynamic, traces the forward once. The backend:

1. splits the FX graph with `split_module` at every *split op* (the language model's attention):
   each split op becomes its own submodule, the nodes between two of them a *piece*;
2. turns each split op into a direct call of its Python implementation (the custom op exists for
   the tracer; dispatching it costs more host time than its kernels take), which runs eagerly,
   with the step's real metadata, between pieces;
3. compiles each piece once for the dynamic size with the chosen compiler: `eager` (the traced
   graph as it is: nothing to compile, fast start) or `inductor` (fused kernels; artifacts kept in a
   disk cache keyed by a hash of torch, the GPU, the model and the compiler settings, so a second
   start loads instead of compiling; structurally equal pieces of different layers compile once);
4. wraps each piece in a `PieceRunner` that, for every size of the schedule, captures its own CUDA
   graph (when the owner runs a capture forward) and replays it afterwards.

The owner (e.g. `language/prefill_graphs.py`) sets `PiecewiseState.size` to the padded size of
each forward; sizes without graphs run the compiled pieces directly. Pieces and split points sit
in the stitching module as plain callables (no `nn.Module` call per piece). The first forward at
a captured size records a `ReplayPlan`, the straight sequence of its graph replays and split-op
calls (checked: every split op reads only piece outputs and constants); later forwards at that
size run the plan through `PiecewiseState.run_planned`, without dynamo's guard check or the
stitching code (`MMPIPE_DISABLE=prefill-plans` turns plans off). A plan bypasses dynamo's guards, so it
relies on what they would check staying put: the model's parameters, the KV cache tensors and the
owner's static buffers are never replaced while the graphs live. With `MMPIPE_CHECK_GRAPH_INPUTS=1`
every forward takes the compiled path (addresses checked) and is compared with its plan.

Memory. All pieces of all sizes capture into one `GraphMemory` (a shared pool), largest size
first. Piece outputs are kept as weak references after capture (they do not own their blocks, so
later captures reuse them); the last piece's outputs become weak inside its capture. A replay
returns the same addresses every time: the inputs of piece k+1 are the outputs of piece k, or
buffers the split ops write in place, or the owner's static input buffers. The returned final
outputs alias graph memory: consume them before the next replay of any graph of that memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from mmpipe import settings
from mmpipe.graphs.cache import GraphCache
from mmpipe.graphs.memory import CaptureMemory
from mmpipe.kernels import triton

log = logging.getLogger("mmpipe")

COMPILERS = ("eager", "inductor")


# ---------------------------------------------------------------------------- weak references

def weak_ref(value: Any) -> Any:
    """A tensor that views `value`'s memory without owning it (non-tensors pass through). Its
    memory stays valid only while something else (a graph's pool) keeps it."""
    if not isinstance(value, torch.Tensor):
        return value
    storage = value.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
    return torch.empty(0, dtype=value.dtype, device=value.device).set_(weak, value.storage_offset(), value.shape,
                                                                       value.stride())


def weak_refs(outputs: Any) -> Any:
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(weak_ref(o) for o in outputs)
    return weak_ref(outputs)


# ---------------------------------------------------------------------------- splitting

@dataclass
class SplitItem:
    name: str  # attribute of the split module ("submod_3")
    index: int  # position in execution order
    is_split: bool  # a split op (runs eagerly) rather than a piece
    module: fx.GraphModule


def split_graph(gm: fx.GraphModule, split_ops: Sequence[Any]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split `gm` before and after every call of an op in `split_ops`; returns the stitching
    module (which calls the submodules in order) and its submodules in execution order."""
    targets = set(split_ops)
    partition: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in targets:
            current += 1
            partition[node] = current
            current += 1
        else:
            partition[node] = current
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    items = []
    for node in split.graph.nodes:
        if node.op == "call_module":
            module = getattr(split, node.target)
            is_split = any(n.op == "call_function" and n.target in targets for n in module.graph.nodes)
            items.append(SplitItem(node.target, len(items), is_split, module))
    return split, items


def call_directly(module: fx.GraphModule, implementations: dict[Any, Callable[..., Any]]) -> None:
    """Point the split op's node at its Python implementation (same arguments)."""
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in implementations:
            node.target = implementations[node.target]
    module.recompile()


# ---------------------------------------------------------------------------- compilers

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


def launch_triton_directly(module: fx.GraphModule) -> int:
    """Point the tracer's Triton kernel nodes (`triton_kernel_wrapper_mutation`) at a plain launch
    through `mmpipe.kernels.launch` (same kernel, arguments and grid). Run as a higher-order op,
    each call costs ~1 ms of host dispatch: 12,644 of them were 14 s of the 3B shape's start-up
    (two forwards per schedule size); inside graphs nothing changes. Returns the nodes changed."""
    if triton is None:
        return 0
    wrapper = getattr(torch.ops.higher_order, "triton_kernel_wrapper_mutation", None)
    changed = 0
    for node in module.graph.nodes:
        if node.op == "call_function" and wrapper is not None and node.target is wrapper:
            node.target = _launch_traced_kernel
            changed += 1
    if changed:
        module.recompile()
    return changed


def _launch_traced_kernel(*, kernel_idx: int, constant_args_idx: int, grid: list[Any],
                          tma_descriptor_metadata: Any, kwargs: dict[str, Any], **rest: Any) -> None:
    """What `triton_kernel_wrapper_mutation_dense` does for a one-grid launch without TMA
    descriptors, through the direct launcher; anything else takes that function itself."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if tma_descriptor_metadata or len(grid) != 1 or rest:
        wrap.triton_kernel_wrapper_mutation_dense(kernel_idx=kernel_idx, constant_args_idx=constant_args_idx,
                                                  grid=grid, tma_descriptor_metadata=tma_descriptor_metadata,
                                                  kwargs=kwargs, **rest)
        return
    from mmpipe.kernels.launch import launch

    kernel = wrap.kernel_side_table.get_kernel(kernel_idx)
    values = {**kwargs, **wrap.kernel_side_table.get_constant_args(constant_args_idx)}
    if not hasattr(kernel, "params"):  # an autotuner: Triton's own call picks the config
        kernel[tuple(grid[0])](**values)
        return
    positional = []
    for param in kernel.params:  # runtime arguments in signature order, constexprs by keyword
        if param.is_constexpr or param.name not in values:
            break
        positional.append(values.pop(param.name))
    launch(kernel, tuple(grid[0]), *positional, **values)


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


# ---------------------------------------------------------------------------- runtime

@dataclass
class PiecewiseStats:
    graphs_seen: int = 0  # graphs torch.compile handed to the backend (1 when nothing re-traces)
    pieces: int = 0
    split_points: int = 0
    compilations: int = 0  # piece compilations (inductor); cache hits and loads are not counted
    compile_cache_loads: int = 0
    compile_seconds: float = 0.0  # tracing, splitting and compiling
    direct_triton_launches: int = 0  # traced Triton kernel calls turned into direct launches (eager pieces)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PiecewiseState:
    """Shared by the owner and every piece of one compiled forward."""

    cache: GraphCache | None
    size: int | None = None  # the padded token count of this forward; None: no graphs
    capturing: bool = False
    memory: CaptureMemory | None = None  # the capture memory the pieces of a size share
    # Compare every piece's input addresses at replay with those at capture (a test and debug aid:
    # a mismatch means a graph would read stale memory).
    check_inputs: bool = field(default_factory=lambda: settings.current().check_graph_inputs)
    input_addresses: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)
    num_pieces: int = 0
    # Which traced graph the pieces belong to (a re-trace makes new pieces that must not replay
    # the graphs captured for the old ones): graph keys are (generation, size, piece index).
    generation: int = 0
    plans: dict[tuple[int, int], "ReplayPlan"] = field(default_factory=dict)  # (generation, size)
    recording: "Recording | None" = None
    # Off: every forward goes through dynamo's guards and the stitching module (debugging, and
    # measuring what the plans save).
    plans_enabled: bool = field(default_factory=lambda: settings.current().prefill_plans)

    def run_planned(self, size: int, forward: Callable[[], Any]) -> Any:
        """A forward at a captured `size`: replay its plan, or run `forward` (the compiled
        forward, through dynamo's guards and the stitching code) while recording one."""
        if not self.plans_enabled:
            return forward()
        plan = self.plans.get((self.generation, size))
        if plan is not None and not self.check_inputs:
            return plan.run()
        generation = self.generation
        self.recording = Recording()
        try:
            output = forward()
        finally:
            recording, self.recording = self.recording, None
        if plan is not None:  # checking: the compiled path (addresses checked) must match the plan
            if not plan.same_as(recording, output):
                raise RuntimeError(f"prefill size {size}: the forward no longer matches its replay plan")
            plan.runs += 1
            return output
        plan = recording.finish(output)
        if plan is not None and self.generation == generation:
            self.plans[(generation, size)] = plan
        return output

    def drop_plans(self) -> None:
        self.plans.clear()


class ReplayPlan:
    """A captured size's forward as the straight sequence it always is: replay piece 0, attention
    on piece 0's outputs, replay piece 1, ... Running it skips dynamo's guard check, the stitching
    module and the per-piece dispatch (about 0.35 ms of host time per 3B forward, before the first
    kernel). Valid because at a captured size every piece returns the same tensors (its graph's
    outputs) and every split point reads only those and constants."""

    __slots__ = ("steps", "output", "runs")

    def __init__(self, steps: list[tuple[Callable[..., Any], tuple[Any, ...]]], output: Any) -> None:
        self.steps, self.output = steps, output
        self.runs = 0  # forwards served by the plan (or, with input checks on, verified against it)

    def run(self) -> Any:
        for fn, args in self.steps:
            fn(*args)
        self.runs += 1
        return self.output

    def same_as(self, recording: "Recording", output: Any) -> bool:
        """Whether a recorded forward made exactly this plan's calls, on the same objects."""
        if not recording.valid or output is not self.output or len(recording.steps) != len(self.steps):
            return False
        return all(f1 == f2 and len(a1) == len(a2) and all(x is y or (type(x) is type(y) and
                                                               not isinstance(x, torch.Tensor) and x == y)
                                                           for x, y in zip(a1, a2))
                   for (f1, a1), (f2, a2) in zip(recording.steps, self.steps))


class Recording:
    """The calls of one forward at a captured size, checked as they come: a plan is made only if
    every piece replayed its graph and every split point's tensors are outputs of earlier pieces
    (anything else could change between forwards) and it returns nothing."""

    def __init__(self) -> None:
        self.steps: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.produced: set[int] = set()  # ids of the tensors pieces returned
        self.valid = True

    def piece(self, replay: Callable[..., Any], entry: Any) -> None:
        self.steps.append((replay, (entry,)))
        outputs = entry.output if isinstance(entry.output, (tuple, list)) else (entry.output,)
        self.produced.update(id(o) for o in outputs if isinstance(o, torch.Tensor))

    def split(self, fn: Callable[..., Any], args: tuple[Any, ...], result: Any) -> None:
        known = all(id(a) in self.produced for a in args if isinstance(a, torch.Tensor))
        constant = all(isinstance(a, (torch.Tensor, int, float, bool, str, type(None))) for a in args)
        returns_nothing = result is None or (isinstance(result, tuple) and not result)  # split_module: ()
        if not returns_nothing or not known or not constant:
            self.valid = False
        self.steps.append((fn, args))

    def finish(self, output: Any) -> ReplayPlan | None:
        if not self.valid or not isinstance(output, torch.Tensor) or id(output) not in self.produced:
            return None
        return ReplayPlan(self.steps, output)


def _addresses(args: Sequence[Any]) -> list[int]:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else -1 for a in args]


class PieceRunner:
    """One piece: its compiled callable, plus one CUDA graph per captured size (in the state's
    graph cache, keyed (size, piece index))."""

    def __init__(self, index: int, runnable: Callable[..., Any], state: PiecewiseState, last: bool) -> None:
        self.index, self.runnable, self.state, self.last = index, runnable, state, last
        self.generation = state.generation

    def __call__(self, *args: Any) -> Any:
        state = self.state
        size = state.size
        if size is None or state.cache is None or (self.generation, size) in state.cache.failed:
            return self._run(args)
        key = (self.generation, size, self.index)
        if state.capturing:
            return self._capture(key, args)
        entry = state.cache.graphs.get(key)
        if entry is None:  # not captured (should not happen: the owner checks sizes)
            return self._run(args)
        if state.check_inputs and _addresses(args) != state.input_addresses[key]:
            moved = [i for i, (a, b) in enumerate(zip(_addresses(args), state.input_addresses[key])) if a != b]
            raise RuntimeError(f"piece {self.index} at size {size}: inputs {moved} moved since capture; the "
                               "graph would read stale memory")
        state.cache.replay(entry)
        if state.recording is not None:
            state.recording.piece(state.cache.replay, entry)
        return entry.output

    def _run(self, args: tuple[Any, ...]) -> Any:
        if self.state.recording is not None:  # a piece without its graph: no plan for this size
            self.state.recording.valid = False
        return self.runnable(*args)

    def _capture(self, key: tuple[int, int, int], args: tuple[Any, ...]) -> Any:
        state = self.state
        assert state.cache is not None
        if self.last:  # the final outputs become weak inside the capture: their blocks return to the pool
            def body() -> Any:
                return weak_refs(self.runnable(*args))
        else:
            def body() -> Any:
                return self.runnable(*args)
        entry = state.cache.capture(key, body, f"prefill {key[1]} tokens, piece {self.index}", warmups=0,
                                    shared=state.memory, quiet=True)
        if entry is None:  # logged by the cache; this size runs without graphs from now on
            state.cache.mark_failed(key[:2])
            return self.runnable(*args)
        outputs, entry.output = entry.output, weak_refs(entry.output)
        if state.check_inputs:
            state.input_addresses[key] = _addresses(args)
        return outputs


class PiecewiseBackend:
    """The `torch.compile` backend. `split_ops`: op overloads to split at, mapped to the Python
    functions the split points call instead."""

    def __init__(self, split_ops: dict[Any, Callable[..., Any]], compiler: PieceCompiler,
                 state: PiecewiseState) -> None:
        self.split_ops, self.compiler, self.state = split_ops, compiler, state
        self.stats = PiecewiseStats()
        self.split_module: fx.GraphModule | None = None
        self.items: list[SplitItem] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        self.stats.graphs_seen += 1
        self.state.generation = self.stats.graphs_seen
        if self.stats.graphs_seen > 1:
            log.warning("the prefill forward was traced again (graph %d): its pieces run without graphs until "
                        "captured", self.stats.graphs_seen)
        split, items = split_graph(gm, list(self.split_ops))
        piece_inputs = self._piece_inputs(gm, split, items) if self.compiler.name != "eager" else {}
        pieces = [item for item in items if not item.is_split]
        for item in items:
            if item.is_split:
                call_directly(item.module, self.split_ops)
                _install_plain(split, item.name, SplitPoint(item.module.forward, self.state))
                continue
            runnable = self.compiler.compile(item.module, piece_inputs.get(item.name, ()))
            runner = PieceRunner(pieces.index(item), runnable, self.state, last=item is pieces[-1])
            _install_plain(split, item.name, runner)
        self.stats.pieces += len(pieces)
        self.stats.split_points += len(items) - len(pieces)
        self.stats.compilations = self.compiler.compilations
        self.stats.compile_cache_loads = getattr(self.compiler, "loads", 0)
        self.stats.direct_triton_launches = getattr(self.compiler, "direct_triton_launches", 0)
        self.stats.compile_seconds += time.perf_counter() - start
        self.state.num_pieces = len(pieces)
        self.split_module, self.items = split, items
        return split.forward

    @staticmethod
    def _piece_inputs(gm: fx.GraphModule, split: fx.GraphModule, items: list[SplitItem]) -> dict[str, tuple]:
        """Fake example inputs of every piece (symbolic sizes included): `split_module` keeps the
        tracer's example values on the pieces' placeholders."""
        return {item.name: tuple(n.meta["example_value"] for n in item.module.graph.nodes if n.op == "placeholder")
                for item in items if not item.is_split}


class SplitPoint:
    """A split op between pieces: runs eagerly; recorded into the size's plan when one is made."""

    __slots__ = ("fn", "state")

    def __init__(self, fn: Callable[..., Any], state: PiecewiseState) -> None:
        self.fn, self.state = fn, state

    def __call__(self, *args: Any) -> Any:
        result = self.fn(*args)
        if self.state.recording is not None:
            self.state.recording.split(self.fn, args, result)
        return result


def _install_plain(split: fx.GraphModule, name: str, fn: Callable[..., Any]) -> None:
    """Make `split.<name>` a plain callable rather than a submodule: the stitching code calls it
    once per piece and split point (73 times per forward on the 3B shape), and a submodule costs an
    `nn.Module.__getattr__` and `__call__` each time."""
    split._modules.pop(name, None)
    object.__setattr__(split, name, fn)
