"""Units that adapt: split a unit that is too heavy to balance, down the module tree.

The planner can only cut between units, so a unit heavier than a stage's fair share makes that
share unreachable.  :func:`refine_units` starts from ``auto``'s units (:func:`planner.graph.
group_units`) and, for the largest stage count P the profile is meant for (``--max-stages``,
default 8), applies two rules until neither changes anything:

1. **No unit heavier than a fair share.**  A unit whose estimated cost exceeds total / P is
   split: the module its nodes share (the longest common module path of its deepest nodes) is
   opened into its child modules, and a leaf module into its graph nodes.  (The root opens
   into the model's top-level modules.)  An opening that splits nothing is not kept.
2. **At least P units** when the graph has at least P compute nodes: while there are fewer,
   the heaviest unit that can still be split is.

A unit that is one graph node stays whole.  Models built of many similar blocks (24 decoder
layers) keep one unit per block; a model of a few heavy blocks, or with one dominant layer, is
refined where it needs it.

The cost of a node is an estimate that needs no timing: its FLOPs in one forward
(``torch.utils.flop_counter``) plus 4 per element it outputs (elementwise work and memory
traffic).  Costs are integers proportional to the batch, but the choice of modules to open is
recorded (``Profile.grouping``, ``Plan.unit_expansions``) so the runtime regroups from the
record and never re-estimates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx import Interpreter, Node
from torch.utils.flop_counter import FlopCounterMode

from planner.graph import UnitSpec, compute_nodes, group_units
from planner.trace import TracedModel

__all__ = ["DEFAULT_MAX_STAGES", "node_costs", "refine_units"]

#: The stage count ``pipeplan profile`` refines units for unless told (``--max-stages``).
DEFAULT_MAX_STAGES = 8


def _numel(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return sum(_numel(v) for v in value)
    if isinstance(value, dict):
        return sum(_numel(v) for v in value.values())
    return 0


class _Costs(Interpreter):
    def __init__(self, traced: TracedModel, mode: FlopCounterMode) -> None:
        super().__init__(traced.gm)
        self.mode = mode
        self.costs: dict[str, int] = {}

    def run_node(self, n: Node) -> Any:
        before = self.mode.get_total_flops()
        out = super().run_node(n)
        if n.op in ("call_module", "call_function", "call_method"):
            self.costs[n.name] = int(self.mode.get_total_flops() - before) + 4 * _numel(out)
        return out


def node_costs(traced: TracedModel, example_inputs: Sequence[Any]) -> dict[str, int]:
    """Estimated cost of every compute node on ``example_inputs`` (see the module docstring).

    Runs the graph once without gradients; the model's buffers are left as they were.
    """
    saved = [(b, b.detach().clone()) for b in traced.gm.buffers()]
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as mode:
            interp = _Costs(traced, mode)
            interp.run(*example_inputs)
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)
    return interp.costs


def _common_path(traced: TracedModel, unit: UnitSpec) -> tuple[str, ...]:
    """The module to open to split ``unit``: the common path of its deepest nodes."""
    from planner.graph import _common_prefix, _module_info

    by_name = {n.name: n for n in traced.gm.graph.nodes}
    paths = {
        _module_info(traced.gm, by_name[x])[0] for x in unit.nodes if by_name[x].op != "get_attr"
    }
    # Glue that joined the unit lives in an ancestor module (a residual add in the model's own
    # forward): it does not say which module to open.
    deepest = [p for p in paths if not any(q[: len(p)] == p and q != p for q in paths)]
    return _common_prefix(deepest)


def refine_units(
    traced: TracedModel,
    costs: dict[str, int],
    max_stages: int = DEFAULT_MAX_STAGES,
    granularity: str = "auto",
) -> tuple[list[UnitSpec], tuple[str, ...]]:
    """``auto``'s units, refined for up to ``max_stages`` stages; and the modules opened.

    Returns the units and the dotted paths of the opened modules (``""``: the root), which
    ``group_units(traced, granularity, expanded)`` turns back into the same units.  Other
    granularities than ``auto`` are returned as they are.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 4)))
    >>> from planner.trace import trace_model
    >>> traced = trace_model(net, (torch.randn(2, 4),))
    >>> units, opened = refine_units(traced, node_costs(traced, (torch.randn(2, 4),)), 3)
    >>> [u.name for u in units], opened
    (['0', '1.0', '1.1'], ('1',))
    """
    if max_stages < 1:
        raise ValueError(f"max_stages must be at least 1, got {max_stages}")
    opened: list[str] = []
    units = group_units(traced, granularity)
    if granularity != "auto":
        return units, ()
    ops = {n.name: n.op for n in traced.gm.graph.nodes}
    n_compute = sum(1 for n in compute_nodes(traced.gm) if n.op != "get_attr")
    total = sum(costs.values()) or 1
    tried: set[tuple[str, ...]] = set()

    def cost(u: UnitSpec) -> int:
        return sum(costs.get(x, 0) for x in u.nodes)

    def splittable(u: UnitSpec) -> tuple[str, ...] | None:
        path = _common_path(traced, u)
        compute = sum(1 for x in u.nodes if ops[x] != "get_attr")
        return path if compute > 1 and path not in tried else None

    while True:
        heavy = [
            p for u in units if cost(u) * max_stages > total and (p := splittable(u)) is not None
        ]
        if not heavy and len(units) < min(max_stages, n_compute):
            ranked = sorted(units, key=cost, reverse=True)
            heavy = next(([p] for u in ranked if (p := splittable(u)) is not None), [])
        if not heavy:
            return units, tuple(opened)
        for path in dict.fromkeys(heavy):  # keep an opening only if it splits something
            tried.add(path)
            finer = group_units(traced, granularity, [*opened, ".".join(path)])
            if len(finer) > len(units):
                opened.append(".".join(path))
                units = finer
