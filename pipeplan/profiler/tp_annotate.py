"""What of each unit tensor parallelism divides: Megatron's split, read off one run on ``meta``.

:func:`annotate_profile` fills ``Unit.tensor_parallel`` (a
:class:`~pipeplan.planner.types.UnitTensorParallel`) for every unit holding a projection that
:func:`pipeplan.intake.tp_layout.find_layout` splits, and ``Profile.tensor_parallel_note``
for a model with none.  Every new profile is annotated (:mod:`pipeplan.profiler.assemble`); it
costs one run of the traced graph on ``meta`` (:class:`~pipeplan.intake.meta.MetaInterpreter`),
no memory and no measurement.

**Which tensors are sharded.**  Under Megatron's split a tensor is divided over the t ranks
exactly when it lies between a column-wise projection and the row-wise one that closes its
sub-block: a column-wise projection's output is sharded (each rank holds 1 / t of the heads or
hidden units), so is every node with a sharded input (the rotary embedding of the local heads,
the attention's scores, the MLP's activation), and a row-wise projection's output is whole
again (its all-reduce).  The walk goes over the graph in order, node by node; a node belongs to
a projection when its module path (``nn_module_stack``, or the ``call_module`` target) is that
projection's.

**The fields, per unit** (the nodes ``Unit.nodes``, at the largest micro-batch size B):

- ``styles``: the split modules whose weights are among ``Unit.params``; ``divisors``: the
  layout's sizes t must divide that concern them (their split features, and the heads where
  the unit holds an attention projection).
- ``sharded_param_bytes``: the split projections' weights, and the biases of the column-wise
  ones, in the profile's dtype (a row-wise bias is added after the all-reduce, whole), and
  the per-head tables of their attention modules (:func:`head_tables`: T5's relative-position
  bias).
- ``sharded_flop_fraction``: F_s / F, forward FLOPs (``torch.utils.flop_counter``, on
  ``meta``) of the split projections and of the sharded nodes (the attention between them),
  over the unit's forward FLOPs.
- ``sharded_saved_fraction``: S_s / S, over the tensors autograd saves in the unit's forward
  (``saved_tensors_hooks``, each base tensor once, parameters excluded as the profiler
  excludes them): the bytes of those a sharded node made (or, for a tensor no node returns,
  such as an attention kernel's statistics, the node that saved it, if sharded).  The
  profiler's own ``saved_bytes`` counts storages on the device; the fraction is of the same
  tensors counted on ``meta``.
- ``sequence_saved_fraction``: S_q / S, the bytes of those saved only by nodes that sequence
  parallelism runs on 1 / t of the sequence (a row-wise output, then every per-token op of
  one, :func:`~pipeplan.intake.per_token.per_token`: the norms and residuals between the
  sub-blocks).  A tensor that some other node saves too (a norm's output that the column-wise
  projections save) is saved whole there, gathered, and is not counted.
- ``allreduces``: the row-wise projections (one all-reduce each in the forward, one of the
  input's gradient in the backward); ``allreduce_bytes_per_sample``: their outputs' bytes / B.
- ``allgather_bytes_per_sample``: a ``colwise_gather`` head's whole output / B, which its
  forward all-gathers (its FLOPs are split; its output, gathered, is not sharded);
  ``gather_input_bytes_per_sample``: its input / B, whose gradient the backward all-reduces.

A unit with no split module gets ``None``.

**Per cut**, ``Cut.tp_gather_bytes_per_sample``: the bytes of its tensors that a sharded node
made, which the stage before the cut all-gathers (:mod:`pipeplan.intake.tp_stages`).  A
block's output is whole after its row-wise projection, so these are the tensors of a cut inside
a sub-block (between a column-wise projection and its row-wise one) and per-head values a
layer hands to the next: T5's relative-position bias, looked up in a head table that is split
with the heads (so its lookup is sharded too, here as at run time).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import Node
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from pipeplan.intake.graph import _module_info
from pipeplan.intake.meta import MetaInterpreter, trace_meta
from pipeplan.intake.per_token import per_token
from pipeplan.intake.spec import ModelSpec, NamedInputs, cast_floating
from pipeplan.intake.tp_layout import Layout, find_layout, is_head_table, unit_styles
from pipeplan.intake.trace import TracedModel
from pipeplan.planner.errors import FingerprintMismatchError
from pipeplan.planner.types import Profile, UnitTensorParallel

__all__ = ["annotate_profile", "annotate_traced", "head_tables", "model_layout"]

#: Leaf names of attention projections: a unit holding one of them also depends on the heads.
_ATTENTION = frozenset(
    {"q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value"}
    | {"query_proj", "key_proj", "value_proj", "o_proj", "o", "out_proj"}
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def model_layout(module: nn.Module) -> Layout | str:
    """:func:`~pipeplan.intake.tp_layout.find_layout` of ``module``, its names as the
    traced graph gives them: a :class:`~pipeplan.intake.spec.NamedInputs` wrapper (what
    pipeplan makes of a ``transformers`` model) is looked through, so the model's own
    ``config`` is read, and its names gain the wrapper's ``model.`` prefix."""
    if isinstance(module, NamedInputs):
        inner = find_layout(module.model)
        if isinstance(inner, str):
            return inner
        divisors = {  # a size keyed by a module's full name ("a.b.dense features") too
            (f"model.{k}" if "." in k.split(" ", 1)[0] else k): v for k, v in inner.divisors.items()
        }
        return Layout({f"model.{k}": v for k, v in inner.styles.items()}, divisors, inner.source)
    return find_layout(module)


def head_tables(attention: nn.Module) -> list[str]:
    """The children of an attention module (the parent of column-wise projections) that hold
    one column per head and so split with them: T5's relative-position bias table (an
    ``nn.Embedding`` whose name says ``bias``)."""
    return [
        name
        for name, sub in attention.named_children()
        if isinstance(sub, nn.Embedding) and is_head_table(name)
    ]


@dataclass
class _NodeStats:
    flops: int = 0
    sharded: bool = False
    split: bool = False
    """The node belongs to a split projection (its FLOPs are divided)."""
    seq: bool = False
    """Under sequence parallelism its output holds 1 / t of the sequence: a row-wise output, or
    a per-token op (:func:`~pipeplan.intake.per_token.per_token`) of such a one."""
    saved: list[tuple[int, int, bool, bool]] = field(default_factory=list)
    """(key of the base tensor, its bytes, whether a sharded node made it, whether this node
    saves it per token under sequence parallelism: its share of the sequence)."""
    out_bytes: int = 0
    in_bytes: int = 0
    """Its first argument's bytes (a split projection's input)."""


class _Walk(MetaInterpreter):
    """Runs the graph on ``meta`` with autograd on, recording per node its forward FLOPs,
    whether its output is sharded, and the tensors autograd saves while it runs."""

    def __init__(
        self, traced: TracedModel, styles: Mapping[str, str], tables: Sequence[str] = ()
    ) -> None:
        super().__init__(traced.gm)
        self.traced = traced
        self.styles = styles
        self.tables = set(tables)
        """The head tables' module paths: a lookup in one holds only the rank's heads."""
        self.stats: dict[str, _NodeStats] = {}
        self.made: dict[int, bool] = {}
        """id of a node output's base tensor -> whether a sharded node made it."""
        self.keep: list[Tensor] = []  # holds the keyed tensors so their ids stay theirs
        self.current: _NodeStats | None = None
        self.counter = FlopCounterMode(display=False)

    def run_node(self, n: Node) -> Any:
        path = ".".join(_module_info(self.traced.gm, n)[0])
        style = self.styles.get(path)
        stats = _NodeStats(split=style is not None)
        if style == "colwise" or path in self.tables:
            stats.sharded = True
        elif style is None:
            stats.sharded = any(self.stats[a.name].sharded for a in n.all_input_nodes)
        first = self.env.get(n.args[0]) if n.args and isinstance(n.args[0], Node) else None
        if style is None and any(self.stats[a.name].seq for a in n.all_input_nodes):
            module = self.module.get_submodule(str(n.target)) if n.op == "call_module" else None
            stats.seq = per_token(n, module, first.dim() if isinstance(first, Tensor) else None)
        self.stats[n.name] = stats
        if style is not None and isinstance(first, Tensor):
            stats.in_bytes = first.numel() * first.element_size()
        self.current = stats
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        stats.flops = self.counter.get_total_flops() - before
        self.current = None
        if style == "rowwise" and isinstance(out, Tensor) and out.dim() == 3:
            stats.seq = True
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                base = _base(t)
                self.made.setdefault(id(base), stats.sharded)
                self.keep.append(base)
                stats.out_bytes += t.numel() * t.element_size()
        return out

    def pack(self, t: Tensor) -> Tensor:
        base = _base(t)
        if self.current is not None and not (base.is_leaf and base.requires_grad):
            self.keep.append(base)
            sharded = self.made.get(id(base), self.current.sharded)
            nbytes = base.numel() * base.element_size()
            self.current.saved.append((id(base), nbytes, sharded, self.current.seq))
        return t

    def walk(self, example: Sequence[Any]) -> dict[str, _NodeStats]:
        with (
            torch.enable_grad(),
            self.counter,
            torch.autograd.graph.saved_tensors_hooks(_weak_pack(self), lambda t: t),
        ):
            self.run(*example)
        return self.stats


def _weak_pack(walk: _Walk) -> Callable[[Tensor], Tensor]:
    """``walk.pack`` through a weak reference.  Autograd keeps a pack hook in C++, where the
    garbage collector cannot see it; a bound method there kept the walk, its traced graph and
    the model's real weights alive for good (measured: the bundled GPT's 708.8 MiB of bfloat16
    weights held on a GPU after its profile)."""
    ref = weakref.ref(walk)

    def pack(t: Tensor) -> Tensor:
        w = ref()
        return t if w is None else w.pack(t)

    return pack


def _base(t: Tensor) -> Tensor:
    return t if t._base is None else t._base


def _unit_entry(
    layout: Layout,
    params: Sequence[str],
    nodes: Sequence[str],
    stats: Mapping[str, _NodeStats],
    path_of: Mapping[str, str],
    modules: Mapping[str, nn.Module],
    elem: int,
    batch: int,
) -> UnitTensorParallel | None:
    styles = unit_styles(layout, params)
    if not styles:
        return None
    split_tensors: list[Any] = []
    for name, style in styles.items():
        lin = modules[name]
        split_tensors += [getattr(lin, "weight", None)]
        split_tensors += [getattr(lin, "bias", None) if style != "rowwise" else None]
    wanted = set(params)
    for parent in {n.rsplit(".", 1)[0] for n, st in styles.items() if st == "colwise" and "." in n}:
        for child in head_tables(modules[parent]):
            if f"{parent}.{child}.weight" in wanted:
                split_tensors.append(getattr(modules[f"{parent}.{child}"], "weight", None))
    sharded_params = sum(
        t.numel() * (elem if t.is_floating_point() else t.element_size())
        for t in split_tensors
        if isinstance(t, Tensor)
    )
    total = split = 0
    saved: dict[int, tuple[int, bool, bool]] = {}
    for name in nodes:
        s = stats[name]
        total += s.flops
        if s.split or s.sharded:
            split += s.flops
        for key, nbytes, sharded, seq in s.saved:
            size, was, every = saved.get(key, (0, False, True))
            saved[key] = (max(size, nbytes), was or sharded, every and seq)
    rowwise = [m for m, st in styles.items() if st == "rowwise"]
    gathered = [m for m, st in styles.items() if st == "colwise_gather"]

    def output_bytes(modules: list[str]) -> int:
        ends = [[n for n in nodes if path_of[n] == m] for m in modules]
        return sum(stats[last[-1]].out_bytes for last in ends if last)

    out_bytes, gather_bytes = output_bytes(rowwise), output_bytes(gathered)
    firsts = [[n for n in nodes if path_of[n] == m] for m in gathered]
    gather_in = sum(stats[first[0]].in_bytes for first in firsts if first)
    saved_total = sum(b for b, _, _ in saved.values())
    saved_sharded = sum(b for b, sh, _ in saved.values() if sh)
    saved_seq = sum(b for b, sh, seq in saved.values() if seq and not sh)
    divisors: dict[str, int] = {}
    if {m.rsplit(".", 1)[-1] for m in styles} & _ATTENTION:
        divisors = {k: v for k, v in layout.divisors.items() if k in ("heads", "kv_heads")}
    # The finder keys a module's size by its leaf name, or by its full name where two differ.
    for module_name in styles:
        for dim in (f"{module_name} features", f"{module_name.rsplit('.', 1)[-1]} features"):
            if dim in layout.divisors:
                divisors[dim] = layout.divisors[dim]
                break
    return UnitTensorParallel(
        styles=dict(sorted(styles.items())),
        divisors=divisors,
        sharded_param_bytes=sharded_params,
        sharded_flop_fraction=min(1.0, split / total) if total else 0.0,
        sharded_saved_fraction=min(1.0, saved_sharded / saved_total) if saved_total else 0.0,
        sequence_saved_fraction=saved_seq / saved_total if saved_total else 0.0,
        allreduces=len(rowwise),
        allreduce_bytes_per_sample=-(-out_bytes // batch),
        allgather_bytes_per_sample=-(-gather_bytes // batch),
        gather_input_bytes_per_sample=-(-gather_in // batch),
    )


def annotate_traced(
    profile: Profile, module: nn.Module, traced: TracedModel, example: Sequence[Any]
) -> Profile:
    """``profile`` annotated from ``traced`` (the graph its units were cut from, of
    ``module``) run on ``example`` (the inputs at the largest micro-batch size; real or
    ``meta``)."""
    layout = model_layout(module)
    if isinstance(layout, str):
        return profile.model_copy(update={"tensor_parallel_note": layout})
    gm = traced.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = [n for u in profile.units for n in u.nodes if n not in nodes]
    if missing:
        raise FingerprintMismatchError(
            f"the traced graph has no node {missing[0]!r} of the profile's units; annotate the "
            f"profile with the model it was made from"
        )
    modules = dict(module.named_modules())
    parents = {n.rsplit(".", 1)[0] for n, st in layout.styles.items() if st == "colwise"}
    tables = [f"{p}.{child}" for p in parents if p in modules for child in head_tables(modules[p])]
    stats = _Walk(traced, layout.styles, tables).walk(example)
    path_of = {name: ".".join(_module_info(gm, n)[0]) for name, n in nodes.items()}
    elem = torch.empty((), dtype=_DTYPES.get(profile.dtype, torch.float32)).element_size()
    batch = max(profile.microbatch_sizes)
    units = tuple(
        u.model_copy(
            update={
                "tensor_parallel": _unit_entry(
                    layout, u.params, u.nodes, stats, path_of, modules, elem, batch
                )
            }
        )
        for u in profile.units
    )
    cuts = tuple(
        c.model_copy(
            update={
                "tp_gather_bytes_per_sample": sum(
                    x.bytes_per_sample
                    for x in c.tensors
                    if x.node in stats and stats[x.node].sharded
                )
            }
        )
        for c in profile.cuts
    )
    return profile.model_copy(update={"units": units, "cuts": cuts, "tensor_parallel_note": None})


def annotate_profile(profile: Profile, spec: ModelSpec) -> Profile:
    """``profile`` with every unit's ``tensor_parallel`` filled (module docstring), or with
    ``tensor_parallel_note`` where the model has no layout.  ``spec`` is the model the profile
    was made from (:func:`pipeplan.intake.model.load_model`; built on ``meta`` or for real,
    it is not run): it is traced again on fake tensors at the profile's largest micro-batch
    size, as the profiler traced it."""
    layout = model_layout(spec.module)
    if isinstance(layout, str):
        return profile.model_copy(update={"tensor_parallel_note": layout})
    dtype = _DTYPES.get(profile.dtype, torch.float32)
    module = cast_floating(spec.module, dtype).train()
    example = tuple(
        x.to(dtype) if x.is_floating_point() else x
        for x in spec.batch(max(profile.microbatch_sizes))[0]
    )
    traced = trace_meta(module, example, profile.tracer)
    if traced.fingerprint != profile.graph_fingerprint:
        raise FingerprintMismatchError(
            f"the model traces to graph {traced.fingerprint}, the profile to "
            f"{profile.graph_fingerprint}; annotate the profile with the model it was made from"
        )
    return annotate_traced(profile, module, traced, example)
