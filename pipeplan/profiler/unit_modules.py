"""Split a traced model into one callable per unit, and find the parameters each unit owns.

Unit k's callable takes the values it uses but does not make (model inputs or earlier units'
outputs) and returns the values it makes that later units or the model's output use.  A
parameter used by several units (a tied embedding and LM head) is owned by the first: its bytes
count there once, and every user lists its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn
from torch.fx import GraphModule

from pipeplan.intake.graph import UnitSpec, subgraph_module
from pipeplan.intake.trace import TracedModel

__all__: list[str] = []


@dataclass(frozen=True)
class UnitModule:
    """The callable of one unit: ``module(*[values[n] for n in inputs])`` gives ``outputs``."""

    spec: UnitSpec
    module: GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]
    """Parameters and buffers it uses, by their first qualified name in the model."""
    param_bytes: int
    """Bytes of the parameters it owns (uses first)."""
    largest_param_bytes: int = 0
    """Bytes of the largest parameter it uses, owned or not."""


def _tensors_used(gm: GraphModule, spec: UnitSpec) -> list[tuple[str, Tensor]]:
    by_name = {n.name: n for n in gm.graph.nodes}
    used: list[tuple[str, Tensor]] = []
    for name in spec.nodes:
        node = by_name[name]
        if node.op == "get_attr":
            obj: object = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, Tensor):
                used.append((str(node.target), obj))
        elif node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            used += sub.named_parameters(prefix=str(node.target), remove_duplicate=False)
            used += sub.named_buffers(prefix=str(node.target), remove_duplicate=False)
    return used


def split_units(traced: TracedModel, units: list[UnitSpec]) -> list[UnitModule]:
    """One :class:`UnitModule` per unit, in order."""
    gm = traced.gm
    canonical: dict[int, str] = {}
    for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
        canonical.setdefault(id(t), name)
    where = {name: k for k, u in enumerate(units) for name in u.nodes}
    by_name = {n.name: n for n in gm.graph.nodes}
    owned: set[int] = set()
    out: list[UnitModule] = []
    for k, spec in enumerate(units):
        inputs: dict[str, None] = {}
        outputs: list[str] = []
        for name in spec.nodes:
            node = by_name[name]
            for arg in node.all_input_nodes:
                if where.get(arg.name) != k:
                    inputs.setdefault(arg.name)
            if any(u.op == "output" or where[u.name] != k for u in node.users):
                outputs.append(name)
        names: dict[str, None] = {}
        nbytes = largest = 0
        for qualname, t in _tensors_used(gm, spec):
            names.setdefault(canonical.get(id(t), qualname))
            if isinstance(t, nn.Parameter):
                largest = max(largest, t.numel() * t.element_size())
            if id(t) not in owned:
                owned.add(id(t))
                if isinstance(t, nn.Parameter):
                    nbytes += t.numel() * t.element_size()
        module = subgraph_module(traced, spec.nodes, tuple(inputs), outputs)
        out.append(
            UnitModule(spec, module, tuple(inputs), tuple(outputs), tuple(names), nbytes, largest)
        )
    return out
