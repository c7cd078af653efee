"""Which units are the same, so that ``--method units`` measures each distinct unit once.

:func:`unit_signature` is step 2 (identity) of :mod:`pipeplan.profiler.units`, whose docstring
lists what it compares: the module classes node by node, the parameters' and buffers' shapes,
dtypes and ownership and real buffers' values, the input shapes and dtypes at every size, the
traced sub-graph, the producers of the inputs known without parameters, and whether the
model's output reads the unit.  Units of equal signatures are measured once; the others take
the first one's measurement.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from pipeplan.intake.graph import _module_info
from pipeplan.intake.trace import TracedModel, _describe, _position, _target_name, get_attr
from pipeplan.profiler.unit_modules import UnitModule

__all__ = ["unit_signature"]


def _digest(t: Tensor) -> str:
    """A hash of a real tensor's values (a buffer's, or an input's known without parameters)."""
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _tensor_row(t: Any) -> Any:
    if isinstance(t, Tensor):
        return [list(t.shape), str(t.dtype), bool(t.requires_grad)]
    return _describe(t, {})


def unit_signature(
    traced: TracedModel,
    piece: UnitModule,
    values: Mapping[int, Mapping[str, Any]],
    feeds_output: bool,
    owned: Sequence[Tensor] = (),
) -> str:
    """The identity of a unit (step 2 of :mod:`pipeplan.profiler.units`): equal for units
    that are the same; ``values`` holds the observed values of its inputs at every micro-batch
    size, ``owned`` the parameters it owns (a shared one it does not own is not its to
    update)."""
    gm = traced.gm
    tensors = dict(
        [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    )
    params = []
    for name in piece.params:
        t = tensors[name]
        desc = [list(t.shape), str(t.dtype), isinstance(t, nn.Parameter), bool(t.requires_grad)]
        desc.append(any(t is o for o in owned))
        if not isinstance(t, nn.Parameter) and not t.is_meta:
            desc.append(_digest(t))
        params.append(desc)
    by_name = {n.name: n for n in gm.graph.nodes}
    classes = []
    for name in piece.spec.nodes:
        path, stack = _module_info(gm, by_name[name])
        classes.append(stack.get(path, ""))
    sub = piece.module
    index = _position(sub.graph)
    graph: list[Any] = []
    for node in sub.graph.nodes:
        row: list[Any] = [node.op]
        if node.op == "get_attr":
            attr = get_attr(sub, str(node.target))
            row.append(_tensor_row(attr) if isinstance(attr, Tensor) else type(attr).__name__)
        elif node.op == "call_module":
            mod = sub.get_submodule(str(node.target))
            row += [type(mod).__qualname__, mod.extra_repr()]
        elif node.op in ("call_function", "call_method"):
            row.append(_target_name(node))
        row += [_describe(node.args, index), _describe(node.kwargs, index)]
        graph.append(row)
    inputs = []
    for name in piece.inputs:
        per_size = []
        known = False
        for b in sorted(values):
            value = values[b][name]
            per_size.append(tree_map(_tensor_row, value))
            leaves = [t for t in tree_leaves(value) if isinstance(t, Tensor)]
            known = known or (bool(leaves) and not any(t.is_meta for t in leaves))
        inputs.append([per_size, name if known else None])
    text = json.dumps(
        [classes, params, graph, inputs, feeds_output], sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]
