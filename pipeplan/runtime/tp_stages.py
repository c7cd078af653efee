"""Split a stage's traced graph over its tensor-parallel ranks (Megatron's layout, torch's TP).

A stage body is a :class:`~torch.fx.GraphModule` cut from the traced model
(:mod:`pipeplan.runtime.stages`).  :func:`split_stage_body` splits it over the tp dimension of
the plan's mesh with torch's :func:`~torch.distributed.tensor.parallel.parallelize_module`:
every ``nn.Linear`` the layout (:func:`pipeplan.intake.tp_layout.find_layout`) calls
``colwise`` gets :class:`~torch.distributed.tensor.parallel.ColwiseParallel`, every ``rowwise``
one :class:`~torch.distributed.tensor.parallel.RowwiseParallel`, with torch's defaults:

    x (replicated) --colwise--> y_k = x W_k^T (features sharded, local) --> ... local ops on
    this rank's heads / MLP columns ... --rowwise--> sum_k z_k W'_k^T (all-reduce) -> replicated

so each sub-block costs one all-reduce forward (the row-wise output) and one backward (the
column-wise input's gradient).  Everything outside the layout (embeddings, norms, the head)
stays replicated: every tp rank computes it whole on the same values (no sequence parallel in
this first version).

Two things of a traced graph need adapting, done once at build time:

1. **Linears as modules.**  ``torch.export`` records ``aten.linear(x, weight, bias)`` with the
   weights as attributes, not a call of the ``nn.Linear``, so TP's module hooks would never
   run: :func:`_linears_as_modules` puts an ``nn.Linear`` holding the same parameters at the
   layout's path and calls it.  (``torch.fx`` graphs call the module already.)
2. **Baked shapes.**  A trace records sizes as numbers: Llama's ``repeat_kv`` under export is
   ``expand(k, [B, 2, 2, T, D])`` then ``reshape(.., [B, 4, T, D])`` with the global head
   counts.  :func:`_localise_shapes` runs the body once unsplit (recording every node's
   shape, :class:`torch.fx.passes.shape_prop.ShapeProp`) and once split, and where a
   ``view``/``reshape``/``expand`` receives a tensor smaller than it did unsplit it rewrites
   the numbers: the output dimension holding the outermost part of each shrunk input
   dimension shrinks by the same factor.  A ``-1`` and sizes read from the tensor (symbolic)
   are left alone.  The split body must then produce its unsplit output shapes, or the split
   is refused (:class:`~pipeplan.planner.errors.InvalidRequestError`) naming the node.

DTensor outputs kept through attention (``use_local_output=False``) would make the baked
shapes right without rewriting, but DTensor's CPU attention propagates its sharding through
the decomposition of ``scaled_dot_product_attention`` and did not finish a 2-layer Llama in
60 s on CPU (torch 2.13): the local-tensor split is torchtitan's own choice too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._pytree import tree_flatten

from pipeplan.intake.tp_layout import Style
from pipeplan.planner.errors import InvalidRequestError

__all__ = ["split_stage_body"]

_aten = torch.ops.aten
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_EXPANDS = {_aten.expand.default}
_METHODS = {"view": "reshape", "reshape": "reshape", "expand": "expand"}


def split_stage_body(
    body: GraphModule,
    styles: dict[str, Style],
    tp_mesh: Any,
    example_inputs: Sequence[Any],
) -> int:
    """Split ``body`` in place over ``tp_mesh`` (module docstring) by ``styles`` (qualified
    ``nn.Linear`` name -> style; those not in the body are ignored); ``example_inputs`` are
    the values one micro-batch passes it (every tp rank the same).  Collective over the tp
    group.  Returns the number of linears split."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    mine = _linears_as_modules(body, styles)
    if not mine:
        return 0
    with torch.no_grad():
        ShapeProp(body).propagate(*example_inputs)
    plan: dict[str, ParallelStyle] = {
        name: ColwiseParallel() if style == "colwise" else RowwiseParallel()
        for name, style in mine.items()
    }
    parallelize_module(body, tp_mesh, plan)
    _localise_shapes(body, example_inputs)
    return len(mine)


def _linears_as_modules(body: GraphModule, styles: dict[str, Style]) -> dict[str, Style]:
    """The layout's linears that ``body`` runs, each now called as an ``nn.Linear`` module
    (export's ``aten.linear`` on attributes rewritten; see the module docstring)."""
    mine: dict[str, Style] = {}
    for node in list(body.graph.nodes):
        if node.op == "call_module" and node.target in styles:
            if isinstance(body.get_submodule(str(node.target)), nn.Linear):
                mine[str(node.target)] = styles[str(node.target)]
            continue
        if node.op != "call_function" or node.target is not _aten.linear.default:
            continue
        weight = node.args[1]
        if not isinstance(weight, Node) or weight.op != "get_attr":
            continue
        path = str(weight.target).rpartition(".")[0]
        if path not in styles or str(weight.target) != f"{path}.weight":
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None and not (
            isinstance(bias, Node) and bias.op == "get_attr" and bias.target == f"{path}.bias"
        ):
            continue
        owner = body.get_submodule(path)
        weight_param = owner.get_parameter("weight")
        lin = nn.Linear(1, 1, bias=bias is not None, device="meta")
        lin.in_features, lin.out_features = weight_param.shape[1], weight_param.shape[0]
        lin.weight = weight_param
        if bias is not None:
            lin.bias = owner.get_parameter("bias")
        parent, _, leaf = path.rpartition(".")
        setattr(body.get_submodule(parent) if parent else body, leaf, lin)
        with body.graph.inserting_before(node):
            call = body.graph.call_module(path, (node.args[0],))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        body.graph.erase_node(node)
        for attr in (weight, bias):
            if isinstance(attr, Node) and not attr.users:
                body.graph.erase_node(attr)
        mine[path] = styles[path]
    body.graph.lint()
    body.recompile()
    return mine


def _global_shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, Node) else None
    shape = getattr(meta, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else None


def _shape_arg(node: Node) -> tuple[str, int, list[Any]] | None:
    """(kind, where the sizes start, the sizes) of a view, reshape or expand node."""
    if node.op == "call_function" and node.target in _RESHAPES | _EXPANDS:
        kind = "expand" if node.target in _EXPANDS else "reshape"
        sizes = node.args[1]
        return (kind, 1, list(sizes)) if isinstance(sizes, list | tuple) else None
    if node.op == "call_method" and node.target in _METHODS:
        sizes = node.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], list | tuple):
            return _METHODS[str(node.target)], -1, list(sizes[0])
        return _METHODS[str(node.target)], 1, list(sizes)
    return None


def _local_sizes(
    kind: str, g_in: tuple[int, ...], l_in: tuple[int, ...], g_out: tuple[int, ...]
) -> list[int]:
    """The output sizes a rank holding ``l_in`` of a global ``g_in`` gets (module docstring)."""
    out = list(g_out)
    if kind == "expand":
        lead = len(g_out) - len(g_in)
        for i, (g, loc) in enumerate(zip(g_in, l_in, strict=True)):
            if g != loc and g_out[lead + i] == g:
                out[lead + i] = loc
        return out
    suffix_out = [math.prod(g_out[j:]) for j in range(len(g_out) + 1)]
    for i, (g, loc) in enumerate(zip(g_in, l_in, strict=True)):
        if g == loc:
            continue
        outer = math.prod(g_in[i:])
        j = next(j for j in range(len(g_out)) if suffix_out[j] >= outer > suffix_out[j + 1])
        factor = g // loc
        if out[j] % factor:
            raise InvalidRequestError(
                f"a reshape to {list(g_out)} cannot hold 1/{factor} of dimension {i} of "
                f"{list(g_in)} on each tensor-parallel rank; plan --tensor-parallel 1"
            )
        out[j] //= factor
    return out


class _Localiser(Interpreter):
    """Runs the split body once, rewriting baked sizes where a tensor arrives smaller."""

    current: Node | None = None

    def run_node(self, n: Node) -> Any:
        self.current = n
        found = _shape_arg(n)
        if found is not None:
            kind, at, sizes = found
            src = self.env[n.args[0]] if isinstance(n.args[0], Node) else None
            g_in, g_out = _global_shape(n.args[0]), _global_shape(n)
            if isinstance(src, Tensor) and g_in is not None and g_out is not None:
                l_in = tuple(src.shape)
                if l_in != g_in and len(sizes) == len(g_out):
                    local = _local_sizes(kind, g_in, l_in, g_out)
                    new = [
                        local[j] if isinstance(s, int) and s == g_out[j] else s
                        for j, s in enumerate(sizes)
                    ]
                    if new != sizes:
                        args = list(n.args)
                        if at == -1:
                            args[1] = tuple(new) if isinstance(n.args[1], tuple) else new
                        elif n.op == "call_method":
                            args[1:] = new
                        else:
                            args[1] = new
                        n.args = tuple(args)
        return super().run_node(n)


def _localise_shapes(body: GraphModule, example_inputs: Sequence[Any]) -> None:
    body.recompile()
    localiser = _Localiser(body)
    try:
        with torch.no_grad():
            outs = localiser.run(*example_inputs)
    except RuntimeError as exc:  # a size baked where no view, reshape or expand says
        at = localiser.current
        what = f"node {at.name} ({at.target})" if at is not None else "the split stage"
        raise InvalidRequestError(
            f"tensor parallelism: {what} fails on one rank's share of the heads "
            f"({' '.join(str(exc).split())[:200]}); plan --tensor-parallel 1 for this model"
        ) from exc
    body.recompile()
    out_node = next(n for n in body.graph.nodes if n.op == "output")
    nodes, values = tree_flatten(out_node.args[0])[0], tree_flatten(outs)[0]
    for node, value in zip(nodes, values, strict=True):
        want = _global_shape(node)
        if isinstance(value, Tensor) and want is not None and tuple(value.shape) != want:
            raise InvalidRequestError(
                f"tensor parallelism: node {node.name} gives {list(value.shape)} on each rank, "
                f"not the unsplit {list(want)}; plan --tensor-parallel 1 for this model"
            )
