"""Piecewise CUDA graphs: a `torch.compile` backend that splits a traced forward at chosen ops and
turns every piece between them into a per-size CUDA graph (the design of SGLang's and vLLM's
piecewise runners, from `shared/seeds/000` and `003`).

`torch.compile(forward, backend=PiecewiseBackend(...))`, with the token dimension of the inputs
marked dynamic, traces the forward once. The backend:

1. splits the FX graph at every *split op* (the language model's attention): each split op
   becomes its own submodule, the nodes between two of them a *piece* (`fx_passes.split_graph`);
2. turns each split op into a direct call of its Python implementation, which runs eagerly, with
   the step's real metadata, between pieces (`fx_passes.call_directly`);
3. compiles each piece once for the dynamic size with the chosen piece compiler, `eager` or
   `inductor` (`compile_cache`, which also keeps inductor's artifacts on disk);
4. wraps each piece in a `PieceRunner` that, for every size of the schedule, captures its own CUDA
   graph (when the owner runs a capture forward) and replays it afterwards.

The owner (e.g. `language/prefill_graphs.py`) sets `PiecewiseState.size` to the padded size of
each forward; sizes without graphs run the compiled pieces directly. Pieces and split points sit
in the stitching module as plain callables (no `nn.Module` call per piece). The first forward at
a captured size records a `ReplayPlan` (`replay_plan`), the straight sequence of its graph
replays and split-op calls; later forwards at that size run the plan through
`PiecewiseState.run_planned`, without dynamo's guard check or the stitching code
(`MMPIPE_DISABLE=prefill-plans` turns plans off). A plan bypasses dynamo's guards, so it relies on
what they would check staying put: the model's parameters, the KV cache tensors and the owner's
static buffers are never replaced while the graphs live. With `MMPIPE_CHECK_GRAPH_INPUTS=1` every
forward takes the compiled path (addresses checked) and is compared with its plan.

Memory. All pieces of all sizes capture into one `GraphMemory` (a shared pool), largest size
first. Piece outputs are kept as weak references after capture (they do not own their blocks, so
later captures reuse them); the last piece's outputs become weak inside its capture. A replay
returns the same addresses every time: the inputs of piece k+1 are the outputs of piece k, or
buffers the split ops write in place, or the owner's static input buffers. The returned final
outputs alias graph memory: consume them before the next replay of any graph of that memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx

from mmpipe import settings
from mmpipe.graphs.cache import GraphCache
from mmpipe.graphs.compile_cache import PieceCompiler
from mmpipe.graphs.fx_passes import SplitItem, call_directly, split_graph
from mmpipe.graphs.memory import CaptureMemory, weak_refs
from mmpipe.graphs.replay_plan import Recording, ReplayPlan

log = logging.getLogger("mmpipe")


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
    once per piece and split point (dozens of times per forward), and a submodule costs an
    `nn.Module.__getattr__` and `__call__` each time."""
    split._modules.pop(name, None)
    object.__setattr__(split, name, fn)
