"""Sequence parallelism inside a tensor-parallel stage (Megatron's ``--sequence-parallel``).

Tensor parallelism alone (:mod:`pipeplan.intake.tp_stages`) leaves every op outside the split
projections (norms, residual adds, dropout) computed whole on each of the t ranks.  Those ops
act on each token alone, so each rank can hold 1/t of the sequence instead (Korthikanti et
al., 2022).  :func:`shard_sequence` rewrites a stage's traced graph so that:

    hidden (b, S/t, d) per rank --gather--> (b, S, d) --colwise ... rowwise--reduce-scatter-->
    (b, S/t, d) --norm, add, dropout on this rank's tokens--> ...

- a **row-wise** projection whose output is (b, S, d) reduce-scatters it over the sequence
  (``RowwiseParallel(output_layouts=Shard(1))``) in place of the all-reduce;
- a **sequence-sharded** value (a row-wise output, a received hidden state, or a per-token op of
  one) flows through *per-token* ops: aten's pointwise ops, reductions and layer/RMS norms over
  the trailing dimensions (dims >= 2), dtype casts, dropout; ``nn.LayerNorm`` and ``nn.RMSNorm``
  modules of an fx graph become their functional form so their weights are visible;
- any other consumer (a column-wise projection, attention, a whole linear, a slice of the
  sequence) reads it **gathered** once (:class:`SequenceComm` ``gather``: all-gather forward,
  this rank's share of the gradient backward, since every consumer of the gathered value
  leaves each rank the whole gradient: a column-wise projection all-reduces it, a replicated op
  computes it whole);
- a whole value that meets a sharded one in a per-token op, along the sequence (a residual
  from before the first split, an attention output of an unsplit attention) is **scattered**
  (this rank's share forward, all-gather of the gradient backward); a whole value met by
  broadcast (a norm's weight) gets the **partial** gradient of this rank's tokens only, so it
  is all-reduced over the tp group in the backward (``reduce``: identity forward);
- a stage sends and receives each hidden state, a floating (b, S, d) tensor with d the model's
  hidden size (:func:`is_hidden`), as this rank's (b, S/t, d) share, and the last stage
  gathers its outputs whole for the loss.

The split stage's values equal the unsplit stage's: every rewrite is a reordering of the same
sums (the tests compare loss and gradients in float64).  Communication per sub-block matches
the cost model's (:mod:`pipeplan.solvers.tensor_parallel`): forward one all-gather (the
column-wise projections share it) and one reduce-scatter; backward the column-wise inputs'
all-reduces and the row-wise output's all-gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten

from pipeplan.intake.per_token import per_token
from pipeplan.intake.tp_layout import Style
from pipeplan.planner.errors import InvalidRequestError

__all__ = [
    "SequenceComm",
    "SequenceRole",
    "SequenceSplit",
    "hidden_size",
    "is_hidden",
    "local_share",
    "shard_sequence",
]

Kind = Literal["gather", "scatter", "reduce"]


@dataclass(frozen=True)
class SequenceRole:
    """Where a stage body stands for sequence parallelism: the model's ``hidden`` size
    (:func:`hidden_size`), which of its inputs it ``received`` from the previous stage, and
    whether it is the ``last`` stage (whose outputs go whole to the loss)."""

    hidden: int
    received: tuple[bool, ...]
    last: bool


def hidden_size(module: nn.Module, styles: dict[str, Style]) -> int:
    """The model's hidden size: the output features of its row-wise projections.  Raises
    :class:`InvalidRequestError` unless they agree."""
    sizes = {
        int(cast(nn.Linear, module.get_submodule(name)).out_features)
        for name, style in styles.items()
        if style == "rowwise"
    }
    if len(sizes) != 1:
        raise InvalidRequestError(
            f"sequence parallelism needs one hidden size, but the row-wise projections give "
            f"{sorted(sizes) or 'none'}; plan without --sequence-parallel"
        )
    return sizes.pop()


def is_hidden(value: Any, hidden: int) -> bool:
    """Whether ``value`` travels sequence-sharded between stages: a floating (b, S, ``hidden``)
    tensor."""
    return (
        isinstance(value, Tensor)
        and value.is_floating_point()
        and value.dim() == 3
        and value.shape[2] == hidden
    )


def local_share(values: Sequence[Tensor], hidden: int, rank: int, t: int) -> tuple[Tensor, ...]:
    """``values`` with each hidden state (:func:`is_hidden`) cut to tp rank ``rank``'s share of
    its sequence, as a stage sends and receives it.  Raises :class:`InvalidRequestError` where
    t does not divide a hidden state's sequence."""
    out = []
    for v in values:
        if is_hidden(v, hidden):
            s = _share(v.shape[1], t, tuple(v.shape))
            v = v.narrow(1, rank * s, s).contiguous().requires_grad_(v.requires_grad)
        out.append(v)
    return tuple(out)


def _share(length: int, t: int, shape: tuple[int, ...]) -> int:
    if length % t:
        raise InvalidRequestError(
            f"sequence parallelism: --tensor-parallel {t} does not divide the sequence length "
            f"{length} of a hidden state {list(shape)}; plan without --sequence-parallel or "
            f"with a sequence length divisible by {t}"
        )
    return length // t


class SequenceComm(nn.Module):
    """One collective over the tp group along dimension ``dim`` (module docstring): ``gather``
    (all-gather; backward: this rank's share), ``scatter`` (this rank's share; backward:
    all-gather), ``reduce`` (identity; backward: all-reduce)."""

    def __init__(self, kind: Kind, dim: int, rank: int, t: int, group: Any) -> None:
        super().__init__()
        self.kind, self.dim, self.rank, self.t, self.group = kind, dim, rank, t, group

    def forward(self, x: Tensor) -> Tensor:
        return _Comm.apply(x, self)  # type: ignore[no-any-return]

    def gather(self, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(self.t)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.dim)

    def share(self, x: Tensor) -> Tensor:
        s = x.shape[self.dim] // self.t
        return x.narrow(self.dim, self.rank * s, s).contiguous()

    def reduce(self, x: Tensor) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=self.group)
        return x


class _Comm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: SequenceComm) -> Tensor:  # type: ignore[override]
        ctx.comm = comm
        if comm.kind == "gather":
            return comm.gather(x)
        return comm.share(x) if comm.kind == "scatter" else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        comm: SequenceComm = ctx.comm
        if comm.kind == "gather":
            return comm.share(grad), None
        return (comm.gather(grad) if comm.kind == "scatter" else comm.reduce(grad)), None


@dataclass
class SequenceSplit:
    """What :func:`shard_sequence` did to a body."""

    inputs: list[int] = field(default_factory=list)
    """Positions of the body's inputs that arrive as this rank's share."""
    outputs: set[Node] = field(default_factory=set)
    """Output values the body returns as this rank's share."""
    rowwise: set[str] = field(default_factory=set)
    """Row-wise projections whose output is reduce-scattered over the sequence."""


def shard_sequence(
    body: GraphModule,
    styles: dict[str, Style],
    example_inputs: Sequence[Any],
    role: SequenceRole,
    *,
    rank: int,
    t: int,
    group: Any,
) -> SequenceSplit:
    """Rewrite ``body`` in place for sequence parallelism (module docstring).  Its nodes must
    carry the unsplit run's shapes (``ShapeProp``); ``styles`` are the split linears it calls
    (as modules); a hidden state among the inputs ``role.received`` marks arrives as this
    rank's share.  The row-wise projections named in the result are to be split with
    ``output_layouts=Shard(1)``."""
    graph = body.graph
    hidden, received, last = role.hidden, role.received, role.last
    out = SequenceSplit()
    sharded: set[Node] = set()
    grads: set[Node] = set()
    made: dict[tuple[Kind, Node, int], Node] = {}

    def comm(kind: Kind, src: Node, dim: int, before: Node) -> Node:
        key = (kind, src, dim)
        if key not in made:
            name = f"_seq_{kind}_{src.name}"
            body.add_submodule(name, SequenceComm(kind, dim, rank, t, group))
            with graph.inserting_before(before):
                made[key] = graph.call_module(name, (src,))
            made[key].meta = dict(src.meta)
        return made[key]

    def gathered(node: Node) -> None:
        node.args, node.kwargs = map_arg(
            (node.args, node.kwargs),
            lambda a: comm("gather", a, 1, node) if a in sharded else a,
        )

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, (ph, value) in enumerate(zip(placeholders, example_inputs, strict=False)):
        if isinstance(value, Tensor) and value.requires_grad:
            grads.add(ph)
        if i < len(received) and received[i] and is_hidden(value, hidden):
            _share(value.shape[1], t, tuple(value.shape))
            sharded.add(ph)
            out.inputs.append(i)
    for node in list(graph.nodes):
        if node.op in ("placeholder", "output") or node.name.startswith("_seq_"):
            continue
        if node.op == "get_attr":
            value = _attr(body, str(node.target))
            if isinstance(value, Tensor) and value.requires_grad:
                grads.add(node)
            continue
        inputs = node.all_input_nodes
        if any(a in grads for a in inputs) or _has_parameters(body, node):
            grads.add(node)
        style = styles.get(str(node.target)) if node.op == "call_module" else None
        if style == "rowwise":
            gathered(node)
            shape = _shape(node)
            if shape is not None and len(shape) == 3 and shape[2] == hidden:
                _share(shape[1], t, shape)
                out.rowwise.add(str(node.target))
                sharded.add(node)
            continue
        if not any(a in sharded for a in inputs):
            continue
        if node.op == "call_module" and isinstance(
            body.get_submodule(str(node.target)), nn.LayerNorm | nn.RMSNorm
        ):  # made functional, so that its weights' partial gradients can be all-reduced
            node = _functional_norm(body, node)
            inputs = node.all_input_nodes
            grads.update(a for a in inputs if a.op == "get_attr")
            grads.add(node)
        module = body.get_submodule(str(node.target)) if node.op == "call_module" else None
        first = _shape(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
        if not per_token(node, module, None if first is None else len(first)):
            gathered(node)
            continue
        sharded.add(node)
        seq = _shape(node) or _shape(next(a for a in inputs if a in sharded))
        for a in inputs:
            if a in sharded:
                continue
            dim = _aligned(_shape(a), seq)
            if dim is not None:
                node.replace_input_with(a, comm("scatter", a, dim, node))
            elif a in grads and _floating(body, a):
                node.replace_input_with(a, comm("reduce", a, 0, node))
    out_node = next(n for n in graph.nodes if n.op == "output")
    leaves = tree_flatten(out_node.args[0])[0]
    for leaf in dict.fromkeys(x for x in leaves if isinstance(x, Node)):
        meta = leaf.meta.get("tensor_meta")
        hid = not last and _hidden_meta(meta, hidden)
        if hid and leaf in sharded:
            out.outputs.add(leaf)
        elif hid:
            whole = _shape(leaf) or ()
            _share(whole[1], t, whole)
            local = comm("scatter", leaf, 1, out_node)
            out_node.replace_input_with(leaf, local)
            out.outputs.add(local)
        elif leaf in sharded:
            out_node.replace_input_with(leaf, comm("gather", leaf, 1, out_node))
    graph.lint()
    return out


def _attr(body: GraphModule, target: str) -> Any:
    obj: Any = body
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _has_parameters(body: GraphModule, node: Node) -> bool:
    if node.op != "call_module":
        return False
    return any(p.requires_grad for p in body.get_submodule(str(node.target)).parameters())


def _shape(node: Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else None


def _floating(body: GraphModule, node: Node) -> bool:
    if node.op == "get_attr":
        value = _attr(body, str(node.target))
        return isinstance(value, Tensor) and value.is_floating_point()
    meta = node.meta.get("tensor_meta")
    dtype = getattr(meta, "dtype", None)
    return dtype is not None and dtype.is_floating_point


def _hidden_meta(meta: Any, hidden: int) -> bool:
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    return (
        shape is not None
        and dtype is not None
        and dtype.is_floating_point
        and len(shape) == 3
        and int(shape[2]) == hidden
    )


def _aligned(shape: tuple[int, ...] | None, out: tuple[int, ...] | None) -> int | None:
    """The dimension of an input of ``shape`` that lines up with the output's sequence
    (dimension 1 of ``out``, broadcasting from the right), where it is not broadcast."""
    if shape is None or out is None or len(out) < 2:
        return None
    dim = 1 - (len(out) - len(shape))
    return dim if dim >= 0 and shape[dim] == out[1] > 1 else None


def _functional_norm(body: GraphModule, node: Node) -> Node:
    """An fx graph's call of an ``nn.LayerNorm`` / ``nn.RMSNorm`` as ``F.layer_norm`` /
    ``F.rms_norm`` on its parameters read as attributes, so their partial gradients can be
    all-reduced (module docstring)."""
    path = str(node.target)
    norm = cast(nn.LayerNorm | nn.RMSNorm, body.get_submodule(path))
    shape = tuple(norm.normalized_shape)
    graph = body.graph
    with graph.inserting_before(node):
        weight = graph.get_attr(f"{path}.weight") if norm.weight is not None else None
        if isinstance(norm, nn.LayerNorm):
            bias = graph.get_attr(f"{path}.bias") if norm.bias is not None else None
            call = graph.call_function(F.layer_norm, (node.args[0], shape, weight, bias, norm.eps))
        else:
            call = graph.call_function(F.rms_norm, (node.args[0], shape, weight, norm.eps))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    return call
