"""A captured forward replayed as the straight sequence it always is, shared by both piecewise paths.

At a captured size a piecewise forward is always the same calls: replay piece 0, call the split
point (attention) on piece 0's outputs, replay piece 1, ... A `ReplayPlan` runs exactly those,
without dynamo's guard check, the stitching module or the per-piece dispatch. `split_capture`
makes plans as it captures; the traced path (`piecewise`) records one from a forward at a
captured size (`Recording`), and keeps it only if every call could not change between forwards.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Recording", "ReplayPlan"]


class ReplayPlan:
    """A captured size's forward as the straight sequence it always is: replay piece 0, attention
    on piece 0's outputs, replay piece 1, ... Running it skips dynamo's guard check, the stitching
    module and the per-piece dispatch, host time spent before the first kernel (measured in
    docs/performance.md). Valid because at a captured size every piece returns the same tensors
    (its graph's outputs) and every split point reads only those and constants."""

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
