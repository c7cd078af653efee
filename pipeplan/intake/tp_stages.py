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
stays replicated: every tp rank computes it whole on the same values, or, with sequence
parallelism, each on its share of the tokens (:mod:`pipeplan.intake.tp_sequence`).

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
3. **Per-head values made whole.**  T5's relative-position bias (batch 1, heads, q, k) comes
   from a table with one column per head: :func:`_head_tables_as_modules` splits the table
   with the heads (``ColwiseParallel`` on the ``nn.Embedding``), so each rank looks up its own.
   A cross-attention's zero bias is built in the graph with the global head count:
   :func:`_rank_heads` cuts each attention mask that held every head unsplit to the rank's heads.
   A layer hands its bias to the next, so it can leave the stage: an output that holds only
   the rank's heads is all-gathered over the tp group (:class:`_GatherHeads`, its backward the
   reduce-scatter of the gradient) and the next stage cuts it again.

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

from pipeplan.intake.tp_layout import Style, is_head_table, parallel_style
from pipeplan.intake.tp_sequence import SequenceRole, local_share, shard_sequence
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
    sequence: SequenceRole | None = None,
    loss_parallel: bool = False,
) -> int:
    """Split ``body`` in place over ``tp_mesh`` (module docstring) by ``styles`` (qualified
    ``nn.Linear`` name -> style; those not in the body are ignored); ``example_inputs`` are
    the unsplit values one micro-batch passes it (every tp rank the same).  With ``sequence``,
    the ops outside the split projections run on this rank's share of the sequence
    (:func:`pipeplan.intake.tp_sequence.shard_sequence`).  With ``loss_parallel`` a head split
    over the vocabulary leaves its logits split (``Shard(-1)``), for the loss to read so.
    Collective over the tp group.  Returns the number of linears split."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    mine = _linears_as_modules(body, styles)
    if not mine and sequence is None:
        return 0
    tables = _head_tables_as_modules(body, mine)
    with torch.no_grad():
        ShapeProp(body).propagate(*example_inputs)
    plan: dict[str, ParallelStyle] = {name: parallel_style(style) for name, style in mine.items()}
    plan.update((name, ColwiseParallel()) for name in tables)  # its columns are the heads
    if loss_parallel:
        plan.update(
            (name, ColwiseParallel(output_layouts=Shard(-1)))
            for name, style in mine.items()
            if style == "colwise_gather"
        )
    rank, t = tp_mesh.get_local_rank(), tp_mesh.size()
    local, keep = list(example_inputs), set()
    if sequence is not None:
        split = shard_sequence(
            body, mine, example_inputs, sequence, rank=rank, t=t, group=tp_mesh.get_group()
        )
        plan.update((name, RowwiseParallel(output_layouts=Shard(1))) for name in split.rowwise)
        local = [local_share([x], sequence.hidden, rank, t)[0] if i in split.inputs else x
                 for i, x in enumerate(example_inputs)]  # fmt: skip
        keep = split.outputs
    if plan:
        parallelize_module(body, tp_mesh, plan)
    _local_attention_masks(body, rank, t)
    _localise_shapes(body, local, tp_mesh.get_group(), keep, vocab=loss_parallel)
    return len(mine)


def _linears_as_modules(body: GraphModule, styles: dict[str, Style]) -> dict[str, Style]:
    """The layout's linears that ``body`` runs, each now called as an ``nn.Linear`` module
    (export's ``aten.linear`` on attributes rewritten; see the module docstring)."""
    mine = {
        name: styles[name]
        for name in _called_modules(body, nn.Linear)
        if name in styles  # an fx graph calls the module already
    }
    for node, weight in _attribute_calls(body, _aten.linear.default, 1):
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
        _call_as_module(body, node, path, lin, node.args[0], (weight, bias))
        mine[path] = styles[path]
    body.graph.lint()  # recompiled once, when the split is done (_localise_shapes)
    return mine


def _called_modules(body: GraphModule, kind: type[nn.Module]) -> list[str]:
    """The modules of type ``kind`` that ``body`` calls (``call_module``, as fx graphs do)."""
    return [
        str(n.target)
        for n in body.graph.nodes
        if n.op == "call_module" and isinstance(body.get_submodule(str(n.target)), kind)
    ]


def _attribute_calls(body: GraphModule, op: Any, at: int) -> list[tuple[Node, Node]]:
    """(call, attribute) of each call of ``op`` whose argument ``at`` is a ``get_attr`` (a
    weight, as ``torch.export`` records it)."""
    out = []
    for node in list(body.graph.nodes):
        if node.op == "call_function" and node.target is op and len(node.args) > at:
            arg = node.args[at]
            if isinstance(arg, Node) and arg.op == "get_attr":
                out.append((node, arg))
    return out


def _call_as_module(
    body: GraphModule, node: Node, path: str, module: nn.Module, arg: Any, attrs: tuple[Any, ...]
) -> None:
    """Put ``module`` at ``path`` and call it on ``arg`` in place of ``node``, dropping the
    ``attrs`` (``get_attr`` nodes of its parameters) nothing else reads."""
    parent, _, leaf = path.rpartition(".")
    setattr(body.get_submodule(parent) if parent else body, leaf, module)
    with body.graph.inserting_before(node):
        call = body.graph.call_module(path, (arg,))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    body.graph.erase_node(node)
    for attr in attrs:
        if isinstance(attr, Node) and not attr.users:
            body.graph.erase_node(attr)


def _head_tables_as_modules(body: GraphModule, split: dict[str, Style]) -> list[str]:
    """The per-head tables (:func:`pipeplan.intake.tp_layout.is_head_table`) beside the split
    column-wise projections that ``body`` runs, each now called as an ``nn.Embedding`` (export's
    ``aten.embedding`` on an attribute rewritten, as for the linears): split column-wise, each
    rank's lookup gives its own heads' column of T5's relative-position bias."""
    parents = {name.rpartition(".")[0] for name, style in split.items() if style == "colwise"}

    def table(path: str) -> bool:
        parent, _, leaf = path.rpartition(".")
        return parent in parents and is_head_table(leaf)

    found = [name for name in _called_modules(body, nn.Embedding) if table(name)]
    for node, weight in _attribute_calls(body, _aten.embedding.default, 0):
        path, _, attr = str(weight.target).rpartition(".")
        if attr != "weight" or not table(path):
            continue
        if len(node.args) > 2 or node.kwargs:  # a padding index or scaling: not a plain lookup
            continue
        columns = body.get_submodule(path).get_parameter("weight")
        emb = nn.Embedding(1, 1, device="meta")
        emb.num_embeddings, emb.embedding_dim = columns.shape
        emb.weight = columns
        _call_as_module(body, node, path, emb, node.args[1], (weight,))
        found.append(path)
    body.graph.lint()
    return found


def _rank_heads(mask: Tensor, query: Tensor, rank: int, t: int) -> Tensor:
    """``mask`` (batch, heads, q, k) cut to this rank's heads where it holds all t h of them
    and ``query`` (batch, h, q, d) only this rank's share (any other mask as it is)."""
    h = query.shape[1]
    if mask.dim() != 4 or mask.shape[1] != h * t or t == 1:
        return mask
    return mask.narrow(1, rank * h, h)


def _local_attention_masks(body: GraphModule, rank: int, t: int) -> None:
    """Each attention's additive mask that held all the query's heads when the body ran
    unsplit (its ShapeProp shapes) through :func:`_rank_heads`: a mask made whole in the graph
    with the model's head count baked in (T5's zero position bias of a cross-attention,
    ``zeros(1, n_heads, q, k)``) meets only this rank's heads.  A mask that broadcasts over
    the heads (a causal mask, ``(b, 1, q, k)``) is left as it is."""
    for node in list(body.graph.nodes):
        if (
            node.op != "call_function"
            or node.target is not _aten.scaled_dot_product_attention.default
        ):
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        shape, query = _global_shape(mask), _global_shape(node.args[0])
        if not shape or not query or len(shape) != 4 or not 1 < shape[1] == query[1]:
            continue
        with body.graph.inserting_before(node):
            cut = body.graph.call_function(_rank_heads, (mask, node.args[0], rank, t))
        if len(node.args) > 3:
            node.args = (*node.args[:3], cut, *node.args[4:])
        else:
            node.kwargs = {**node.kwargs, "attn_mask": cut}
    body.graph.lint()


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


def _localise_shapes(
    body: GraphModule,
    example_inputs: Sequence[Any],
    group: Any,
    keep: set[Node],
    *,
    vocab: bool = False,
) -> None:
    """Rewrite the body's baked sizes for one rank's share (:class:`_Localiser`); an output
    that leaves the stage holding only this rank's heads (T5's position bias, handed from
    layer to layer) is gathered whole over ``group`` (:class:`_GatherHeads`), so that every
    output but those in ``keep`` (this rank's share of the sequence, sent so) and, with
    ``vocab``, those split in their last dimension only (logits for a parallel loss) has its
    unsplit shape, which the next stage's receive expects."""
    localiser = _Localiser(body)  # an Interpreter: it runs the graph, not the compiled code
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
    out_node = next(n for n in body.graph.nodes if n.op == "output")
    nodes, values = tree_flatten(out_node.args[0])[0], tree_flatten(outs)[0]
    for node, value in zip(nodes, values, strict=True):
        want = _global_shape(node)
        if node in keep or not isinstance(value, Tensor) or want is None:
            continue
        if tuple(value.shape) == want:
            continue
        if hasattr(body, f"_gather_heads_{node.name}"):  # the same node output twice
            continue
        dims = [d for d, (g, loc) in enumerate(zip(want, value.shape, strict=False)) if g != loc]
        if vocab and dims == [len(want) - 1] and len(value.shape) == len(want):
            continue
        if len(value.shape) != len(want) or len(dims) != 1 or want[dims[0]] % value.shape[dims[0]]:
            raise InvalidRequestError(
                f"tensor parallelism: node {node.name} gives {list(value.shape)} on each rank, "
                f"not the unsplit {list(want)}; plan --tensor-parallel 1 for this model"
            )
        name = f"_gather_heads_{node.name}"
        body.add_submodule(name, _GatherHeads(dims[0], group))
        with body.graph.inserting_before(out_node):
            whole = body.graph.call_module(name, (node,))
        out_node.replace_input_with(node, whole)
    body.graph.lint()
    body.recompile()


class _GatherHeads(nn.Module):
    """All-gather over the tensor-parallel group along ``dim`` (the heads), with autograd:
    the backward hands each rank the gradient of its own share, summed over the ranks that
    used it (``all_gather_tensor_autograd``)."""

    def __init__(self, dim: int, group: Any) -> None:
        super().__init__()
        self.dim, self.group = dim, group

    def forward(self, x: Tensor) -> Tensor:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        return all_gather_tensor_autograd(x.contiguous(), self.dim, self.group)
