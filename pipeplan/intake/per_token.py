"""Which graph nodes compute each token from that token alone: where sequence parallelism
may hold 1/t of the sequence (Korthikanti et al., 2022).

A transformer block's ops outside its split projections (norms, residual adds, dropout, casts)
act on every position of the sequence separately, so t ranks can each compute them on their
share of the tokens; attention, a projection's weight gradient and a slice of the sequence
need the whole.  :func:`per_token` answers for one node of a traced graph, ``torch.export``'s
aten ops or ``torch.fx``'s python-level calls and modules, with the sequence at dimension 1
of a (batch, sequence, ...) tensor:

- aten's ops tagged ``pointwise``, dtype casts, copies, aliases and dropout;
- reductions (mean, sum, amax, var) over dimensions >= 2 only, and layer and RMS norms over
  trailing dimensions that leave the first two;
- a result of a per-token op that returns several (``getitem`` of a tuple);
- fx's arithmetic operators, ``torch.add``/``mul``/..., ``F.gelu``/``relu``/``silu``/
  ``dropout``/``layer_norm``/``rms_norm``, the same-named tensor methods, and the modules
  ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Dropout`` and the activations.

Anything else (a matmul, attention, a view, a slice) is not per token: a conservative answer,
since it only makes a caller gather the sequence whole.  Used by the runtime's rewrite
(:mod:`pipeplan.intake.tp_sequence`) and the profiler's annotation of what it saves
(:mod:`pipeplan.profiler.tp_annotate`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

__all__ = ["per_token"]

_aten = torch.ops.aten

#: aten ops that act on each token alone whatever their arguments (beside the pointwise tag).
_SAME = {
    _aten._to_copy.default,
    _aten.to.dtype,
    _aten.to.dtype_layout,
    _aten.clone.default,
    _aten.alias.default,
    _aten.detach.default,
    _aten.dropout.default,
    _aten.native_dropout.default,
}
#: aten reductions: per token where every reduced dimension is >= 2 (argument 1: the dims).
_REDUCE = {
    _aten.mean.dim,
    _aten.sum.dim_IntList,
    _aten.amax.default,
    _aten.var.correction,
    _aten.var_mean.correction,
}
#: aten norms over the trailing ``normalized_shape`` (argument 1).
_NORMS = {_aten.native_layer_norm.default, _aten.layer_norm.default, _aten.rms_norm.default}
#: torch.fx's python-level calls that act on each token alone.
_FX_SAME: set[Callable[..., Any]] = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    operator.pow,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.rsqrt,
    torch.tanh,
    torch.sigmoid,
    torch.exp,
    F.gelu,
    F.relu,
    F.silu,
    F.dropout,
}
_FX_METHODS = {"to", "float", "half", "double", "type_as", "contiguous", "add", "mul", "sub",
               "div", "pow", "rsqrt", "neg"}  # fmt: skip
_FX_MODULES = (nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Identity, nn.LayerNorm, nn.RMSNorm)


def per_token(node: Node, module: nn.Module | None, ndim: int | None) -> bool:
    """Whether ``node`` computes each token from that token alone (module docstring).
    ``module``: what a ``call_module`` node calls; ``ndim``: the number of dimensions of its
    first input, ``None`` where that is not a tensor (a tuple of results) or not known."""
    target = node.target
    if target is operator.getitem:  # one result of a per-token op giving several
        return ndim is None and isinstance(node.args[0], Node)
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        if torch.Tag.pointwise in target.tags or target in _SAME:
            return True
        if ndim is None or len(node.args) < 2 or not isinstance(node.args[1], list | tuple):
            return False
        if target in _REDUCE:
            return all(int(cast(int, d)) % ndim >= 2 for d in node.args[1])
        return target in _NORMS and ndim - len(node.args[1]) >= 2
    if node.op == "call_function":
        if target is F.layer_norm or target is F.rms_norm:
            norm = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            return ndim is not None and ndim - len(cast(tuple[int, ...], norm)) >= 2
        return target in _FX_SAME
    if node.op == "call_method":
        return target in _FX_METHODS
    return node.op == "call_module" and isinstance(module, _FX_MODULES)
