"""Units that adapt: split a unit that is too heavy to balance, down the module tree.

The planner can only cut between units, so a unit heavier than a stage's fair share makes that
share unreachable.  :func:`refine_units` starts from ``auto``'s units (:func:`pipeplan.intake.graph.
group_units`) and, for the largest stage count P the profile is meant for (``--max-stages``,
default 8), applies two rules until neither changes anything:

1. **No unit heavier than a fair share.**  A unit whose estimated cost exceeds total / P is
   split: the module its nodes share (the longest common module path of its deepest nodes) is
   opened into its child modules, and a leaf module into its graph nodes.  (The root opens
   into the model's top-level modules.)  An opening that splits nothing is not kept.  A unit
   that no opening splits (glue around a leaf module, modules whose nodes interleave, such as
   a final norm and an LM head in an exported graph) is **cut** between two of its graph nodes,
   where its cost divides most evenly (``cut:NODE``, :func:`pipeplan.intake.graph.group_units`), if
   the lighter side weighs at least 1/8 of total / P (cutting a residual add off a dominant
   layer helps nothing).
2. **At least P units** when the graph has at least P compute nodes: while there are fewer,
   the heaviest unit that can still be split is, by an opening or else by a cut (a cut worth
   it as above first, then any).

A unit that is one graph node stays whole, and a cut never separates a tuple or list from the
items taken out of it (``operator.getitem``), which would cross it as a constant; so a graph
whose only splits are there has fewer units than compute nodes.  Models built of many similar blocks (24 decoder
layers) keep one unit per block; a model of a few heavy blocks, or with one dominant layer, is
refined where it needs it.

The cost of a node is an estimate that needs no timing: its FLOPs in one forward
(``torch.utils.flop_counter``) plus 4 per element it outputs (elementwise work and memory
traffic).  Costs are integers proportional to the batch, but the choice of modules to open is
recorded (``Profile.grouping``, ``Plan.unit_expansions``) so the runtime regroups from the
record and never re-estimates.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Interpreter, Node
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.intake.graph import CUT, UnitSpec, compute_nodes, group_units
from pipeplan.intake.meta import has_meta
from pipeplan.intake.trace import TracedModel

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


class _FakeCosts(_Costs):
    """:class:`_Costs` with the ``meta`` parameters of a model built on ``meta``
    (:mod:`pipeplan.intake.meta`) replaced by fake tensors of the inputs' device: the same kernels as
    the real model (``meta`` ones choose others: attention's math path), so the same counts."""

    def __init__(self, traced: TracedModel, mode: FlopCounterMode, device: torch.device) -> None:
        super().__init__(traced, mode)
        self.device = device
        self.fakes: dict[int, Tensor] = {}

    def _fake(self, value: Any) -> Any:
        def one(t: Any) -> Any:
            if not isinstance(t, Tensor) or not t.is_meta:
                return t
            if id(t) not in self.fakes:
                self.fakes[id(t)] = torch.empty_strided(
                    t.shape, t.stride(), dtype=t.dtype, device=self.device
                )
            return self.fakes[id(t)]

        return tree_map(one, value)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._fake(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        sub = self.fetch_attr(target)
        state = {
            k: self._fake(v)
            for k, v in [*sub.named_parameters(), *sub.named_buffers()]  # type: ignore[union-attr]
        }
        return torch.func.functional_call(sub, state, tuple(args), kwargs)  # type: ignore[arg-type]


def node_costs(traced: TracedModel, example_inputs: Sequence[Any]) -> dict[str, int]:
    """Estimated cost of every compute node on ``example_inputs`` (see the module docstring).

    Runs the graph once without gradients; the model's buffers are left as they were.  A
    model with parameters on ``meta`` (:mod:`pipeplan.intake.meta`) runs on fake tensors of the
    inputs' device, which give the same counts without memory.
    """
    saved = [(b, b.detach().clone()) for b in traced.gm.buffers() if not b.is_meta]
    fake = has_meta(traced.gm)
    device = next(
        (x.device for x in example_inputs if isinstance(x, Tensor) and not x.is_meta),
        torch.device("cpu"),
    )
    try:
        with contextlib.ExitStack() as stack:
            if fake:
                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(torch.no_grad())
            mode = stack.enter_context(FlopCounterMode(display=False))
            interp = _FakeCosts(traced, mode, device) if fake else _Costs(traced, mode)
            interp.run(*example_inputs)
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)
    return interp.costs


def _common_path(traced: TracedModel, unit: UnitSpec) -> tuple[str, ...]:
    """The module to open to split ``unit``: the common path of its deepest nodes."""
    from pipeplan.intake.graph import _common_prefix, _module_info

    by_name = {n.name: n for n in traced.gm.graph.nodes}
    paths = {
        _module_info(traced.gm, by_name[x])[0] for x in unit.nodes if by_name[x].op != "get_attr"
    }
    # Glue that joined the unit lives in an ancestor module (a residual add in the model's own
    # forward): it does not say which module to open.
    deepest = [p for p in paths if not any(q[: len(p)] == p and q != p for q in paths)]
    return _common_prefix(deepest)


def _cut_entry(
    unit: UnitSpec, ops: dict[str, str], costs: dict[str, int], bad: set[str]
) -> tuple[str, int] | None:
    """``cut:NODE`` for the node of ``unit`` before which its cost divides most evenly (the
    earliest on a tie), and the cost of the lighter side; ``None`` when it has no place to cut:
    fewer than two compute nodes, or only places in ``bad`` (where a tuple would cross)."""
    compute = [x for x in unit.nodes if ops[x] != "get_attr"]
    total = sum(costs.get(x, 0) for x in unit.nodes)
    best: tuple[int, str] | None = None
    left = 0
    for x in unit.nodes:
        if ops[x] != "get_attr" and x != compute[0] and x not in bad:
            worst = max(left, total - left)
            if best is None or worst < best[0]:
                best = (worst, x)
        left += costs.get(x, 0)
    return (f"{CUT}{best[1]}", total - best[0]) if best is not None else None


def _tuple_crossings(traced: TracedModel) -> set[str]:
    """Nodes a cut must not precede: those after a node whose items are taken out with
    ``operator.getitem``, up to its last user (the container would cross the cut)."""
    nodes = list(traced.gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    bad: set[str] = set()
    for n in nodes:
        if any(u.op == "call_function" and u.target is operator.getitem for u in n.users):
            last = max(order[u] for u in n.users)
            bad.update(m.name for m in nodes[order[n] + 1 : last + 1])
    return bad


def refine_units(
    traced: TracedModel,
    costs: dict[str, int],
    max_stages: int = DEFAULT_MAX_STAGES,
    granularity: str = "auto",
) -> tuple[list[UnitSpec], tuple[str, ...]]:
    """``auto``'s units, refined for up to ``max_stages`` stages; and the modules opened.

    Returns the units and the dotted paths of the opened modules (``""``: the root) and the
    cuts (``cut:NODE``), which ``group_units(traced, granularity, expanded)`` turns back into
    the same units.  Other granularities than ``auto`` are returned as they are.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 4)))
    >>> from pipeplan.intake.trace import trace_model
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
    tried: set[str] = set()
    bad = _tuple_crossings(traced)

    def cost(u: UnitSpec) -> int:
        return sum(costs.get(x, 0) for x in u.nodes)

    def split(u: UnitSpec) -> tuple[str, bool] | None:
        """The module to open to split ``u``, else a cut, and whether it is worth it: an
        opening is, a cut if its lighter side weighs at least 1/8 of a fair share (cutting a
        residual add off a dominant layer is not); ``None`` if ``u`` cannot split."""
        if sum(1 for x in u.nodes if ops[x] != "get_attr") < 2:
            return None
        path = ".".join(_common_path(traced, u))
        if path not in tried:
            return path, True
        cut = _cut_entry(u, ops, costs, bad)
        if cut is None or cut[0] in tried:
            return None
        return cut[0], cut[1] * 8 * max_stages >= total

    while True:
        heavy = [
            s[0]
            for u in units
            if cost(u) * max_stages > total and (s := split(u)) is not None and s[1]
        ]
        if not heavy and len(units) < min(max_stages, n_compute):
            ranked = [s for u in sorted(units, key=cost, reverse=True) if (s := split(u))]
            worth = [s for s in ranked if s[1]] or ranked
            heavy = [worth[0][0]] if worth else []
        if not heavy:
            return units, tuple(opened)
        for entry in dict.fromkeys(heavy):  # keep an opening only if it splits something
            tried.add(entry)
            finer = group_units(traced, granularity, [*opened, entry])
            if len(finer) > len(units):
                opened.append(entry)
                units = finer
