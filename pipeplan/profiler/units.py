"""Profile a model without building it: each distinct unit materialized alone, measured once.

``pipeplan profile --method units`` (:func:`pipeplan.profiler.whole.profile_model`).  The model is
built with its parameters on ``meta`` (:func:`pipeplan.intake.model.load_model` ``meta=True``; buffers
stay real), traced on fake tensors (:func:`pipeplan.intake.meta.trace_meta`: the graph and fingerprint
of the real model) and grouped into units as the whole-pass profiler groups them (the cost
estimate of :func:`pipeplan.intake.refine.node_costs` runs on fake tensors of the device, so the
units are the same).  Then, at every micro-batch
size b:

1. **Values.**  The graph runs once on the real batch of ``make_batch(b)`` with an
   interpreter that computes a node for real when none of its inputs is on ``meta`` and on
   ``meta`` otherwise (:class:`_Observer`).  Whatever depends only on the model's inputs and
   buffers (attention masks, position ids, rotary tables) so has its real values, as the
   model makes them; activations have their shapes, dtypes and strides.  The cut table
   (bytes of every tensor live across a cut) and the model's input bytes come from these.
2. **Identity.**  Units that are the same are measured once
   (:func:`pipeplan.profiler.unit_identity.unit_signature`): same module classes node by
   node, the same parameter and buffer shapes, dtypes, ownership (a tied weight a unit uses
   but does not own is not its to update) and (for real buffers) values, the same input
   shapes and dtypes at every size, the same traced sub-graph (ops, targets, argument
   structure and constants, node names replaced by positions, leaf modules by their class and
   ``extra_repr``), and the same producers of the inputs whose values are known without
   parameters (a layer reading the sliding-window mask
   is not merged with one reading the full causal mask; the first layer, which reads the
   model's input and so computes no input gradient, is not merged with the others).  A unit
   whose outputs the model's output reads is never merged with one whose outputs it does not
   (its loss is measured).
3. **Measurement.**  Each distinct unit, in order, has the modules owning its parameters
   materialized alone on the device (:func:`pipeplan.intake.meta.materialize`: initialised per module
   from the seed, as a pipeline rank initialises them), is fed its inputs (real values where
   known, the batch's token ids included; seeded normal floats, and zeros for integers and
   booleans, where only the shape is known: a unit that fails on them raises
   :class:`~pipeplan.planner.errors.UnitMeasureError`) and measured by :func:`pipeplan.profiler.sweep.
   measure_sweep` exactly as a whole-pass profile measures a unit inside the model: forward,
   backward, the same recomputing, saved bytes, output bytes, ``rounds`` x ``repeats`` after
   ``warmup``.  Its inputs other than the model's own are differentiated, as in a whole pass.
   A unit whose outputs the model's output reads is measured with the model's loss (the loss
   timing: the loss on the last unit's output shapes); others with the sum of their outputs
   (untimed).  Then one step of every optimizer over the parameters it owns is timed
   (:func:`pipeplan.profiler.measure.measure_updates`), and its parameters go back to ``meta``
   (:func:`pipeplan.intake.meta.dematerialize`).  Peak memory is about one unit's parameters, their
   gradients and the optimizer's states, and its activations; not the model.
4. **Copies.**  Every other unit takes the measurement of the first unit identical to it
   (``Unit.measured_as``).  The update curve sums the units' own steps, each net of a step's
   fixed cost (one step over one element), over the same growing prefixes as the whole-pass
   curve, plus that fixed cost once (:func:`pipeplan.profiler.measure.summed_update_curve`).

What differs from ``--method whole``: a unit alone runs with its weights and inputs hot in the
caches instead of a whole pass after the other units (:mod:`pipeplan.profiler.sweep` explains why that
matters for small units on a CPU), its recomputing times are closed over itself instead of
over the whole model's one checkpoint, and the optimizer's step is summed per unit instead of
timed over growing prefixes of the model.  Parameter, saved, output and cut bytes are the
same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node
from torch.utils._pytree import tree_leaves, tree_map

from pipeplan.intake.graph import cut_tensors
from pipeplan.intake.meta import MetaInterpreter, dematerialize, materialize, trace_meta
from pipeplan.intake.model import ModelSpec, load_model
from pipeplan.intake.spec import cast_floating
from pipeplan.intake.trace import TracedModel
from pipeplan.planner.errors import PipeplanError, UnitMeasureError
from pipeplan.planner.types import OptimizerName, Profile, Timing
from pipeplan.profiler.assemble import (
    LossModule,
    Recipe,
    assemble_profile,
    merge_rounds,
    split_model,
)
from pipeplan.profiler.device import Clock
from pipeplan.profiler.measure import (
    measure_checkpoint_call,
    measure_updates,
    storage_keys,
    summed_update_curve,
    value_bytes,
)
from pipeplan.profiler.sweep import OutputFn, measure_sweep
from pipeplan.profiler.unit_identity import unit_signature
from pipeplan.profiler.unit_modules import UnitModule

__all__ = [
    "activation_estimate",
    "build_meta",
    "observe",
    "param_bytes",
    "profile_units",
    "realize",
]


def _to(value: Any, dev: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor):
        return value.to(dev, dtype) if value.is_floating_point() else value.to(dev)
    return value


def _any_meta(*values: Any) -> bool:
    return any(isinstance(t, Tensor) and t.is_meta for t in tree_leaves(values))


class _Observer(MetaInterpreter):
    """Runs a graph for real where no input of a node is on ``meta``, and on ``meta`` where one
    is; keeps the values of the nodes ``keep`` names."""

    def __init__(self, gm: GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.kept: dict[str, Any] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.name in self.keep:
            self.kept[n.name] = out
        return out

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return Interpreter.placeholder(self, target, args, kwargs)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return Interpreter.get_attr(self, target, args, kwargs)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if _any_meta(args, kwargs):
            return super().call_function(target, args, kwargs)
        return Interpreter.call_function(self, target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if _any_meta(args, kwargs):
            return super().call_method(target, args, kwargs)
        return Interpreter.call_method(self, target, args, kwargs)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        sub = self.fetch_attr(target)
        state = [*sub.parameters(), *sub.buffers()]  # type: ignore[union-attr]
        if _any_meta(args, kwargs, state):
            return super().call_module(target, args, kwargs)
        return Interpreter.call_module(self, target, args, kwargs)


def observe(
    traced: TracedModel, inputs: Sequence[Any], keep: set[str]
) -> tuple[dict[str, Any], Any]:
    """The values of the nodes ``keep`` names and the model's output, from one run of the graph
    on ``inputs`` (real where they need no parameter on ``meta``, step 1 of the module
    docstring).  No gradients; buffers are left as they were."""
    saved = [(b, b.detach().clone()) for b in traced.gm.buffers() if not b.is_meta]
    try:
        with torch.no_grad():
            interp = _Observer(traced.gm, keep)
            out = interp.run(*inputs)
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)
    return interp.kept, out


def build_meta(
    model: str,
    model_kwargs: Mapping[str, Any] | None,
    dev: torch.device,
    dtype: torch.dtype,
    batch_size: int,
    tracer: str,
) -> tuple[ModelSpec, nn.Module, tuple[Any, ...], TracedModel]:
    """The model built on ``meta`` (real buffers moved to ``dev``), in ``dtype``, training mode;
    a real example batch of ``batch_size``; and the graph traced on fake tensors."""
    spec = load_model(model, model_kwargs, meta=True)
    module = cast_floating(spec.module, dtype).train()
    moved: dict[int, Tensor] = {}
    for mod in module.modules():
        for key, buf in list(mod._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != dev:
                mod._buffers[key] = moved.setdefault(id(buf), buf.to(dev))
    example = tuple(_to(x, dev, dtype) for x in spec.batch(batch_size)[0])
    traced = trace_meta(module, example, tracer)
    return spec, module, example, traced


class _Sizes(MetaInterpreter):
    """Sums the bytes of every compute node's output, on ``meta``."""

    total = 0

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.op not in ("placeholder", "get_attr", "output"):
            self.total += value_bytes(out)
        return out


def activation_estimate(traced: TracedModel, example: Sequence[Any]) -> int:
    """Every compute node's output at the example batch, summed, from a run on ``meta`` (an
    upper bound on what a forward saves for backward); the model may be real or on ``meta``."""
    with torch.no_grad():
        sizes = _Sizes(traced.gm)
        sizes.run(*example)
    return sizes.total


def param_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s parameters (each once) in ``dtype`` where floating point."""
    params = {id(p): p for p in module.parameters()}.values()
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in params)


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s strides lay its elements out without gaps or overlaps (a permutation
    of a contiguous layout).

    >>> _dense(torch.empty(2, 3).t()), _dense(torch.empty(3).expand(2, 3))
    (True, False)
    """
    expected = 1
    dims = sorted(((s, d) for d, s in zip(t.shape, t.stride()) if d != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def realize(value: Any, dev: torch.device, gen: torch.Generator) -> Any:
    """``value`` with every ``meta`` tensor replaced by a real one of its shape, dtype and
    strides (seeded normal floats; zeros otherwise) on ``dev``; real tensors moved there."""

    def fill(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if not t.is_meta:
            return t.detach().to(dev)
        if _dense(t):
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        else:
            out = torch.empty(t.shape, dtype=t.dtype)
        if out.is_floating_point() or out.is_complex():
            out.normal_(generator=gen)
        else:
            out.zero_()
        return out.to(dev)

    return tree_map(fill, value)


class _SumLoss(nn.Module):
    """The loss a unit is measured with when the model's output does not read it: the sum of
    its differentiable outputs (every output gets a gradient of ones; untimed)."""

    def forward(self, outputs: Any) -> Tensor:
        sums = [t.sum() for t in tree_leaves(outputs) if isinstance(t, Tensor) and t.requires_grad]
        if not sums:
            return torch.zeros((), requires_grad=True)
        return torch.stack([s.float() for s in sums]).sum()


@contextlib.contextmanager
def _failure(k: int, piece: UnitModule, values: Mapping[str, Any]) -> Iterator[None]:
    """Turn an error of unit ``k`` measured alone into :class:`UnitMeasureError` naming it and
    its integer inputs known only by shape (the likely cause: values such as a mixture of
    experts' routing, computed from parameters in an earlier unit, made up as zeros here)."""
    try:
        yield
    except PipeplanError:
        raise
    except Exception as exc:
        shaped = [
            n
            for n in piece.inputs
            if any(
                isinstance(t, Tensor) and t.is_meta and not t.is_floating_point()
                for t in tree_leaves(values[n])
            )
        ]
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        hint = (
            f"; its integer inputs {', '.join(shaped)} come from parameters in an earlier unit "
            f"and are known here only by their shape (made up as zeros)"
            if shaped
            else ""
        )
        raise UnitMeasureError(
            f"unit {k} ({piece.spec.name}) failed when measured alone: {cause}{hint}; profile "
            f"with --method whole, or with fewer units (--max-stages) so such values stay "
            f"inside one"
        ) from exc


def _owned(pieces: Sequence[UnitModule], traced: TracedModel) -> list[list[Tensor]]:
    """The parameters each unit owns (uses first), by unit."""
    tensors = dict(traced.gm.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    out: list[list[Tensor]] = []
    for p in pieces:
        own: list[Tensor] = []
        for name in p.params:
            t = tensors.get(name)
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                own.append(t)
        out.append(own)
    return out


def profile_units(
    recipe: Recipe,
    *,
    model_kwargs: Mapping[str, Any] | None,
    dev: torch.device,
    torch_dtype: torch.dtype,
    tracer: str,
    max_stages: int,
    progress: Callable[[str, int], Callable[[str], None]],
    seed: int = 0,
) -> Profile:
    """Profile ``recipe.model`` as the module docstring says; ``progress(description, total)``
    gives a callback advanced once per unit and size measured."""
    model, sizes, rounds = recipe.model, recipe.sizes, recipe.rounds
    warmup, repeats = recipe.warmup, recipe.repeats
    b_max = max(sizes)
    spec, module, example, traced = build_meta(model, model_kwargs, dev, torch_dtype, b_max, tracer)
    split = split_model(traced, example, recipe.granularity, max_stages)
    units, pieces, placeholders = split.specs, split.pieces, split.placeholders
    nodes = list(traced.gm.graph.nodes)
    (output_node,) = [n for n in nodes if n.op == "output"]
    output_reads = {n.name for n in output_node.all_input_nodes}
    cuts_names = cut_tensors(traced, units)
    keep = {*placeholders, *output_reads, *(n for p in pieces for n in p.inputs)}
    keep.update(n for names in cuts_names for n in names)

    values: dict[int, dict[str, Any]] = {}
    batches: dict[int, tuple[tuple[Any, ...], Any]] = {}
    for b in sorted(sizes, reverse=True):
        batch_inputs, target = spec.batch(b)
        real = tuple(_to(x, dev, torch_dtype) for x in batch_inputs)
        batches[b] = (real, _to(target, dev, torch_dtype))
        values[b], _ = observe(traced, real, keep)
        values[b].update(zip(placeholders, real))

    feeds = [bool(output_reads & set(p.outputs)) for p in pieces]
    owned = _owned(pieces, traced)
    signatures = [
        unit_signature(traced, p, values, f, own) for p, f, own in zip(pieces, feeds, owned)
    ]
    first: dict[str, int] = {}
    measured_as = [first.setdefault(s, k) for k, s in enumerate(signatures)]
    distinct = [k for k, rep in enumerate(measured_as) if rep == k]

    def output(lookup: Callable[[str], Any]) -> Any:
        flat = torch.fx.node.map_arg(output_node.args[0], lambda n: lookup(n.name))
        return traced.gm.graph.process_outputs(flat)

    clock = Clock(dev)
    call_s = measure_checkpoint_call(dev, clock=clock, warmup=warmup, repeats=20 * repeats * rounds)
    timings: dict[int, dict[int, Timing]] = {}
    loss_runs: dict[int, list[Timing]] = {b: [] for b in sizes}
    updates: dict[int, dict[OptimizerName, float]] = {}
    advance = progress(model, len(distinct) * len(sizes) * rounds)
    for k in distinct:
        piece = pieces[k]
        mods = materialize(module, piece.params, dev, seed=seed, init_weights=spec.init_weights)
        state = [t for t in (*traced.gm.parameters(), *traced.gm.buffers()) if not t.is_meta]
        exclude = storage_keys(state)
        runs: dict[int, list[Timing]] = {b: [] for b in sizes}
        try:
            for _ in range(rounds):
                for b in sorted(sizes, reverse=True):
                    advance(f"{model} unit {k} ({piece.spec.name}) b={b}")
                    gen = torch.Generator().manual_seed(seed * 1_000_003 + k * 1009 + b)
                    names = list(piece.inputs)
                    loss: nn.Module
                    out_fn: OutputFn
                    if feeds[k]:
                        names += [n for n in output_reads if n not in piece.outputs + tuple(names)]
                        loss, out_fn = LossModule(spec.loss, batches[b][1]), output
                    else:
                        outs = piece.outputs

                        def out_fn(
                            lookup: Callable[[str], Any], outs: tuple[str, ...] = outs
                        ) -> Any:
                            return tuple(lookup(n) for n in outs)

                        loss = _SumLoss()
                    inputs = {n: realize(values[b][n], dev, gen) for n in names}
                    with _failure(k, piece, values[b]):
                        result = measure_sweep(
                            [piece],
                            inputs,
                            loss,
                            out_fn,
                            clock=clock,
                            warmup=warmup,
                            repeats=repeats,
                            exclude=exclude,
                            call_s=call_s,
                            frozen=frozenset(n for n in inputs if n in placeholders),
                        )
                    runs[b].append(result.units[0])
                    if feeds[k]:
                        loss_runs[b].append(result.loss)
                    del result, inputs
            for t in owned[k]:
                t.grad = None
            updates[k] = measure_updates(
                owned[k], clock=clock, warmup=warmup, repeats=repeats * rounds, restore=False
            )
        finally:
            for t in traced.gm.parameters():
                t.grad = None
            dematerialize(module, mods, traced.gm, *(p.module for p in pieces))
        timings[k] = {b: merge_rounds(ts) for b, ts in runs.items()}

    unit_bytes = [sum(t.numel() * t.element_size() for t in own) for own in owned]
    one = torch.zeros(1, device=dev, dtype=torch_dtype, requires_grad=True)
    step_s = measure_updates([one], clock=clock, warmup=warmup, repeats=repeats * rounds)
    update_curve = summed_update_curve(unit_bytes, [updates[rep] for rep in measured_as], step_s)
    return assemble_profile(
        recipe,
        split,
        module=spec.module,
        dev=dev,
        values=values[b_max],
        timings=[timings[rep] for rep in measured_as],
        loss={b: merge_rounds(ts) for b, ts in loss_runs.items() if ts},
        update_curve=update_curve,
        call_s=call_s,
        method="units",
        measured_as=measured_as,
    )
