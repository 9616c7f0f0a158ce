"""Rewrites of a traced forward's FX graph for the piecewise backend (`piecewise`).

`split_graph` cuts the graph at every split op (the language model's attention) with
`split_module`, so each split op is its own submodule and the nodes between two of them a piece.
`call_directly` points a split op's node at its Python implementation: the custom op exists for
the tracer, and dispatching it costs more host time than its kernels take. `launch_triton_directly`
does the same for the tracer's Triton kernel nodes, which as a higher-order op cost far more host
time per call than the kernels they launch. Same kernels, same arguments: only the dispatch
changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from mmpipe.kernels import triton

__all__ = ["SplitItem", "call_directly", "launch_triton_directly", "split_graph"]


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


def launch_triton_directly(module: fx.GraphModule) -> int:
    """Point the tracer's Triton kernel nodes (`triton_kernel_wrapper_mutation`) at a plain launch
    through `mmpipe.kernels.launch` (same kernel, arguments and grid). Run as a higher-order op,
    each call costs far more host dispatch than the kernel takes, and a start-up runs thousands of
    them (two forwards per schedule size), a large part of its time (docs/performance.md); inside
    graphs nothing changes. Returns the nodes changed."""
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
