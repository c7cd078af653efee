"""No unit boundary in front of an in-place op: a unit never mutates a value it receives.

A unit's inputs reach it as tensors that require grad and that autograd did not make inside the
unit: the profiler's leaves (:mod:`pipeplan.profiler.sweep`), a pipeline stage's received
activations (``torch.distributed.pipelining``), a recomputing stage's checkpointed inputs.  An
in-place op on one of them (``nn.ReLU(inplace=True)``, ``SiLU``, ``Hardswish`` opening a unit
once refinement splits a block into its children; ``x.add_(y)``; an ``aten`` op whose schema
writes an argument) fails: ``a leaf Variable that requires grad is being used in an in-place
operation``, or, under a checkpoint, a saved input modified before the backward.  Cloning the
input would make the unit differ from the model, and a stage could not clone what the planner
never saw.  So the rule is on the cut: **a node that mutates a value stays in the unit that
made the value**.  :func:`keep_mutations_whole` merges a run into the run before it while it
mutates a value made before it; the merged unit is named after both.

What mutates (:func:`mutated_args`): a ``call_module`` whose module has ``inplace=True``
(its first argument); a ``call_function`` with ``inplace=True`` among its keywords, a
``torch`` function or ``operator`` in-place builtin whose name ends in one ``_``/starts with
``i`` (``torch.relu_``, ``operator.iadd``), or an ``OpOverload`` whose schema writes an
argument (``aten.relu_``, ``aten.add_.Tensor``); a ``call_method`` named ``foo_``.  Values
that are parameters, buffers (``get_attr``) or model inputs (``placeholder``) do not count: no
stage differentiates them.  A write through an alias (an ``nn.Identity``, a view, a reshape,
an item of a tuple) is a write of the value it aliases: timm's ResNet-D runs ``act2``
in place on the output of a disabled ``drop_block``, which is ``bn2``'s output itself.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import nn
from torch.fx import GraphModule, Node

__all__ = ["keep_mutations_whole", "mutated_args"]

_INPLACE_OPERATORS = {
    getattr(operator, f"i{name}")
    for name in [
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
        "matmul",
    ]
}


def _is_inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


def mutated_args(gm: GraphModule, node: Node) -> list[Node]:
    """The graph values ``node`` writes in place (see the module docstring).

    >>> from torch import nn
    >>> gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)))
    >>> [(n.name, [a.name for a in mutated_args(gm, n)]) for n in gm.graph.nodes]
    [('input_1', []), ('_0', []), ('_1', ['_0']), ('output', [])]
    """
    first = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    written: list[Node] = []
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if getattr(module, "inplace", False) is True and first is not None:
            written.append(first)
    elif node.op == "call_method":
        if _is_inplace_name(str(node.target)) and first is not None:
            written.append(first)
    elif node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            for i, arg in enumerate(target._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                    if isinstance(value, Node):
                        written.append(value)
        elif first is not None and (
            node.kwargs.get("inplace") is True
            or target in _INPLACE_OPERATORS
            or _is_inplace_name(getattr(target, "__name__", ""))
        ):
            written.append(first)
    roots = [_alias_root(gm, n) for n in written]
    return [n for n in roots if n.op not in ("get_attr", "placeholder")]


#: Methods and functions whose result may share the storage of their first argument.
_VIEWS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "t",
    "permute", "unsqueeze", "squeeze", "expand", "expand_as", "contiguous", "narrow", "select",
    "as_strided", "movedim", "swapaxes", "chunk", "split", "unbind", "getitem",
}  # fmt: skip


def _alias_root(gm: GraphModule, node: Node) -> Node:
    """The node whose value ``node``'s value aliases (itself when it is new storage): through
    ``nn.Identity`` (timm's disabled ``drop_block``), a dropout that drops nothing, views,
    reshapes and items of a tuple; an in-place op on any of them writes the root's value."""
    while node.args and isinstance(node.args[0], Node):
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            passes = isinstance(module, (nn.Identity, nn.Flatten)) or (
                isinstance(module, nn.modules.dropout._DropoutNd) and module.p == 0.0
            )
            if not passes:
                break
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            returns = node.target._schema.returns
            if not (returns and returns[0].alias_info is not None):
                break
        elif node.op in ("call_function", "call_method"):
            name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
            if name not in _VIEWS:
                break
        else:
            break
        node = node.args[0]
    return node


def keep_mutations_whole(
    bounds: list[tuple[int, int, str]], nodes: Sequence[Node], gm: GraphModule
) -> list[tuple[int, int, str]]:
    """Merge each run ``(first, last, name)`` of ``nodes`` that mutates a value made before it
    into the run before it (named ``earlier+later``), until none does."""
    order = {n: i for i, n in enumerate(nodes)}
    writes: list[tuple[int, int]] = []  # (position of the writer, position of the value)
    for i, n in enumerate(nodes):
        writes += [(i, order[a]) for a in mutated_args(gm, n) if a in order]
    if not writes:
        return bounds
    out = list(bounds)
    k = 1
    while k < len(out):
        lo, hi, name = out[k]
        if any(lo <= w <= hi and v < lo for w, v in writes):
            a, _, before = out[k - 1]
            out[k - 1 : k + 1] = [(a, hi, _join(before, name))]
            k = max(k - 1, 1)
        else:
            k += 1
    return out


def _join(a: str, b: str) -> str:
    return a if a == b else f"{a}+{b}"
