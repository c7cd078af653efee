"""Time every unit of a model inside whole training passes, as a pipeline stage runs them.

A stage runs its units back to back: the forward of unit k starts right after unit k − 1's,
on the activation it just wrote, with unit k's weights last touched a whole pass earlier; the
backward runs them in reverse.  Timing each unit alone in a tight loop, with its weights and
activations hot in the caches, misses that.  Measured on the accuracy benchmark's MLP (width
512, 1 thread, 2-vCPU EPYC with 1 MiB of L2 per core and 1 MiB of weights per layer): the
forwards of the 9 units at micro-batch 16 take 1.04 ms summed when each is timed alone and
1.50 ms inside a pass (5.6 ms and 6.0 ms at 128).  torchgpipe's ``balance_by_time`` times
its layers in sequence for the same reason.

One *pass* at one micro-batch size:

1. forward, unit by unit in order: each unit's floating-point inputs are detached leaves that
   require grad (one leaf per value, shared by all the units that read it), except the
   model's own inputs, which no stage differentiates;
2. the loss on the model's output: forward, then backward;
3. backward, unit by unit in reverse: ``torch.autograd.backward`` from the unit's outputs
   with the gradients its consumers left on their leaves (zeros where a consumer's output did
   not depend on one), so every unit sees the gradient the whole model would give it.

A recomputing pass does the same with every unit under non-reentrant
``torch.utils.checkpoint``: its forward packs the saved tensors away, its backward recomputes
the forward first.  A stage, though, recomputes all its units under one checkpoint, and the
units' own checkpoints summed cost more than that (on the MLP above at micro-batch 32: 1.84x
the plain pass, against 1.45x for one checkpoint around the model).  So a third pass runs
all the units under one checkpoint, and the recomputing times are scaled to it: net of one
checkpoint call each, r_u' - c = (r_u - c) (R - c) / sum_u (r_u - c), with R the whole
pass's time and c one call's own cost.  A fourth pass runs each unit's backward split as the
zero-bubble schedules run it: torch's ``stage_backward_input`` (I, the inputs' gradient) then
``stage_backward_weight`` (W), timed apart, with the intermediate gradients kept between them.
Every repeat runs the first three passes in turn, the last two repeats the fourth as well
(batch-norm statistics restored after all but the first), so all are timed in the same
context.  The first pass counts each unit's saved bytes with ``saved_tensors_hooks`` (each storage once,
parameters and buffers excluded) and its output bytes, and doubles as the first warm-up.
Times are medians over ``repeats`` passes after ``warmup``; spreads are interquartile ranges.
Parameter gradients accumulate across passes, as they do across a step's micro-batches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from pipeplan.planner.types import Timing
from pipeplan.profiler.device import Clock
from pipeplan.profiler.measure import differentiable, median_iqr, saved_storages, value_bytes
from pipeplan.profiler.unit_modules import UnitModule

__all__: list[str] = []

#: Repeats (the last ones) that also run the split pass: I and W serve as the backward's
#: proportions in the schedule solver, so two samples keep their cost to a fraction.
SPLIT_REPEATS = 2

#: The model's output from a lookup of values by node name (the graph's output node).
OutputFn = Callable[[Callable[[str], Any]], Any]


@dataclass(frozen=True)
class SweepResult:
    """One micro-batch size measured: a Timing per unit, the loss's Timing, and the values
    (detached) every unit made in the last pass, by node name."""

    units: list[Timing]
    loss: Timing
    values: dict[str, Any]


@dataclass
class _Samples:
    """Per-pass seconds of one unit (or the loss) and its peak-memory growth."""

    fwd: list[float] = field(default_factory=list)
    bwd: list[float] = field(default_factory=list)
    rec_fwd: list[float] = field(default_factory=list)
    rec_bwd: list[float] = field(default_factory=list)
    bwd_input: list[float] = field(default_factory=list)
    bwd_weight: list[float] = field(default_factory=list)
    weight_held: int | None = None
    peak: int | None = None
    saved: int = 0
    output: int = 0

    def timing(self) -> Timing:
        f, f_iqr = median_iqr(self.fwd)
        b, b_iqr = median_iqr(self.bwd)
        return Timing(
            forward_s=f,
            backward_s=b,
            forward_spread_s=f_iqr,
            backward_spread_s=b_iqr,
            saved_bytes=self.saved,
            output_bytes=self.output,
            peak_bytes=self.peak,
            recompute_forward_s=median_iqr(self.rec_fwd)[0] if self.rec_fwd else None,
            recompute_backward_s=median_iqr(self.rec_bwd)[0] if self.rec_bwd else None,
            backward_input_s=median_iqr(self.bwd_input)[0] if self.bwd_input else None,
            backward_weight_s=median_iqr(self.bwd_weight)[0] if self.bwd_weight else None,
            weight_held_bytes=self.weight_held,
        )


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


class _Pass:
    """The leaves, outputs and gradients of one pass."""

    def __init__(self, inputs: dict[str, Any], frozen: frozenset[str]) -> None:
        self.values: dict[str, Any] = dict(inputs)  # detached values, by node name
        self.frozen = frozen
        self.leaves: dict[str, Any] = {}

    def leaf(self, name: str) -> Any:
        """The value of ``name`` as the pass's one leaf for it (created on first use)."""
        if name not in self.leaves:
            trainable = name not in self.frozen

            def leaf_of(x: Any) -> Any:
                if isinstance(x, Tensor):
                    x = x.detach()
                    if (x.is_floating_point() or x.is_complex()) and trainable:
                        x.requires_grad_(True)
                return x

            # Tensors inside a tuple, namedtuple or dict value (a node that builds the model's
            # output) become leaves too, so the loss's backward stops at this unit.
            self.leaves[name] = tree_map(leaf_of, self.values[name])
        return self.leaves[name]

    def output_grads(
        self, names: Sequence[str], outputs: tuple[Any, ...]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The differentiable output tensors of a unit and the gradients its consumers left."""
        tensors: list[Tensor] = []
        grads: list[Tensor] = []
        for name, out in zip(names, outputs):
            leaf = self.leaves.get(name)
            pairs = (
                zip(tree_leaves(out), tree_leaves(leaf))
                if leaf is not None
                else ((t, None) for t in tree_leaves(out))
            )
            for t, lf in pairs:
                if isinstance(t, Tensor) and t.requires_grad:
                    g = lf.grad if isinstance(lf, Tensor) else None
                    tensors.append(t)
                    grads.append(torch.zeros_like(t) if g is None else g)
        return tensors, grads


def _max_peak(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _counted(
    module: torch.nn.Module, args: list[Any], exclude: set[int], samples: _Samples, clock: Clock
) -> tuple[Any, float]:
    """A plain forward that records the distinct storages autograd saves (except
    ``exclude``'s) in ``samples.saved``; timed, though the hooks make it a warm-up only."""
    with saved_storages(exclude) as seen:
        out, f = clock.time(lambda: module(*args))
    samples.saved = sum(seen.values())
    return out, f


def _forward(module: torch.nn.Module, args: list[Any], recompute: bool) -> Any:
    if recompute:
        return checkpoint(module, *args, use_reentrant=False)
    return module(*args)


def _run_pass(
    pieces: Sequence[UnitModule],
    inputs: dict[str, Any],
    loss: torch.nn.Module,
    output: OutputFn,
    *,
    clock: Clock,
    frozen: frozenset[str],
    recompute: bool,
    record: list[_Samples] | None,
    count: set[int] | None = None,
    split: bool = False,
) -> dict[str, Any]:
    """One pass (see the module docstring); appends its times to ``record`` (units, then the
    loss) when given.  ``count`` (storages to leave out) turns on the saved-bytes count.
    ``split`` runs each unit's backward as torch's zero-bubble schedules do (:func:`_split`) and
    records only those times."""
    state = _Pass(inputs, frozen)
    outs: list[tuple[Any, ...]] = []
    for k, piece in enumerate(pieces):
        args = [state.leaf(n) for n in piece.inputs]
        base = clock.reset_peak()
        if count is not None and record is not None:
            out, f = _counted(piece.module, args, count, record[k], clock)
        else:
            out, f = clock.time(functools.partial(_forward, piece.module, args, recompute))
        out = _as_tuple(out)
        outs.append(out)
        state.values.update(
            zip(piece.outputs, (t.detach() if isinstance(t, Tensor) else t for t in out))
        )
        if record is not None and not split:
            (record[k].rec_fwd if recompute else record[k].fwd).append(f)
            record[k].peak = _max_peak(record[k].peak, clock.peak_since(base))
            if count is not None:
                record[k].output = value_bytes(out)
    # The loss reads the units' own leaves, so its backward leaves the output's gradient on
    # them for the units that made it.  A recomputing pass runs it too, untimed.
    loss_args = [output(state.leaf)]
    if count is not None and record is not None:
        value, lf = _counted(loss, loss_args, count, record[-1], clock)
    else:
        value, lf = clock.time(lambda: loss(*loss_args))
    _, lb = clock.time(lambda: torch.autograd.backward(differentiable(value)))
    if record is not None and not recompute and not split:
        record[-1].fwd.append(lf)
        record[-1].bwd.append(lb)
        if count is not None:
            record[-1].output = value_bytes(value)
    for k in reversed(range(len(pieces))):
        names = pieces[k].outputs
        tensors, grads = state.output_grads(names, outs[k])
        if split:
            args = [state.leaf(n) for n in pieces[k].inputs]
            i_s, w_s, held = _split(pieces[k].module, args, tensors, grads, clock)
            outs[k] = ()
            if record is not None:
                record[k].bwd_input.append(i_s)
                record[k].bwd_weight.append(w_s)
                record[k].weight_held = held
            continue
        base = clock.reset_peak()
        b = (
            clock.time(functools.partial(torch.autograd.backward, tensors, grads))[1]
            if tensors
            else 0.0
        )
        outs[k] = ()
        if record is not None:
            (record[k].rec_bwd if recompute else record[k].bwd).append(b)
            record[k].peak = _max_peak(record[k].peak, clock.peak_since(base))
    return state.values


def _split(
    module: torch.nn.Module,
    args: list[Any],
    tensors: list[Tensor],
    grads: list[Tensor],
    clock: Clock,
) -> tuple[float, float, int]:
    """(I, W, bytes held from I until W) of one unit's backward, run as torch's
        ``stage_backward_input`` then ``stage_backward_weight`` (a pipeline stage's split
        backward).  A unit whose inputs need no gradient (the model's first) runs no I: its W is the
        full backward, as on torch's first stage; so is one whose graph torch cannot split (I = 0, W
    the full backward, retimed).  The bytes held are the intermediate gradients
        ``stage_backward_input`` keeps for W plus the unit's weights' saved inputs (bounded by what
        it saved in the forward; :mod:`pipeplan.solvers.chunks` caps it so)."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    if not tensors:
        return 0.0, 0.0, 0
    # stage_backward_input detaches the outputs in place, which a view refuses and which
    # breaks W when the unit's graph saved its own output (GPT-2's blocks do): the outputs go
    # in as their copies (the copies' backward, a gradient's copy, is timed with I).
    tensors = [t.clone() for t in tensors]
    inputs = [t for t in tree_leaves(args) if isinstance(t, Tensor) and t.requires_grad]
    weights = [w for w in module.parameters() if w.requires_grad]
    if not inputs:
        _, w_s = clock.time(functools.partial(torch.autograd.backward, tensors, grads))
        return 0.0, w_s, 0
    try:
        (_, groups), i_s = clock.time(
            lambda: stage_backward_input(tensors, grads, inputs, iter(weights))
        )
    except RuntimeError:  # torch cannot split this unit's graph: time it whole, as W
        _, w_s = clock.time(functools.partial(torch.autograd.backward, tensors, grads))
        return 0.0, w_s, 0
    held = sum(
        value_bytes(g) for group in groups for g in (group.get("grads") or ()) if g is not None
    )
    _, w_s = clock.time(lambda: stage_backward_weight(iter(weights), groups))
    return i_s, w_s, int(held)


@contextlib.contextmanager
def _buffers_restored(pieces: Sequence[UnitModule]) -> Iterator[None]:
    """Undo buffer updates (batch-norm statistics) of a recomputing pass."""
    buffers = [b for p in pieces for b in p.module.buffers()]
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved):
                b.copy_(v)


def _whole_pass(
    pieces: Sequence[UnitModule],
    inputs: dict[str, Any],
    loss: torch.nn.Module,
    output: OutputFn,
    clock: Clock,
) -> tuple[float, float]:
    """(forward, backward) seconds of all the units under one non-reentrant ``checkpoint``,
    as a recomputing stage holding them all runs them; the backward includes the loss's."""

    def run(*xs: Any) -> Any:
        values = dict(zip(inputs, xs))
        for piece in pieces:
            out = _as_tuple(piece.module(*[values[n] for n in piece.inputs]))
            values.update(zip(piece.outputs, out))
        return output(values.__getitem__)

    args = list(inputs.values())
    out, f = clock.time(lambda: checkpoint(run, *args, use_reentrant=False))
    value = loss(out)
    _, b = clock.time(functools.partial(torch.autograd.backward, differentiable(value)))
    return f, b


def _close(times: list[float], total: float, call: float) -> list[float]:
    """Scale per-unit recomputing times so that, net of one checkpoint call each, they sum to
    ``total`` net of one call: r_u' = call + max(r_u - call, 0) * k.

    >>> [round(t, 3) for t in _close([3.0, 5.0], 6.0, 1.0)]
    [2.667, 4.333]
    """
    net = sum(max(t - call, 0.0) for t in times)
    if net <= 0.0 or total <= call:
        return times
    k = (total - call) / net
    return [call + max(t - call, 0.0) * k for t in times]


def measure_sweep(
    pieces: Sequence[UnitModule],
    inputs: dict[str, Any],
    loss: torch.nn.Module,
    output: OutputFn,
    *,
    clock: Clock,
    warmup: int,
    repeats: int,
    exclude: set[int],
    call_s: tuple[float, float] = (0.0, 0.0),
    frozen: frozenset[str] | None = None,
) -> SweepResult:
    """Time every unit and the loss over ``warmup + repeats`` rounds of passes (a plain one, a
    recomputing one, and all the units under one checkpoint); see the module docstring.

    ``inputs`` maps the model's input nodes to their values (they get no gradient);
    ``exclude`` holds the storages of parameters and buffers (not counted as saved);
    ``call_s`` is what one checkpoint call adds by itself, forward and backward
    (:func:`pipeplan.profiler.measure.measure_checkpoint_call`).  ``frozen`` names the inputs that get
    no gradient (default: all of them; a unit measured alone differentiates the activations it
    reads, :mod:`pipeplan.profiler.units`).
    """
    frozen = frozenset(inputs) if frozen is None else frozen
    record = [_Samples() for _ in range(len(pieces) + 1)]
    values = _run_pass(
        pieces,
        inputs,
        loss,
        output,
        clock=clock,
        frozen=frozen,
        recompute=False,
        record=record,
        count=exclude,
    )
    for s in record:  # the counting pass is the first warm-up
        s.fwd.clear()
        s.bwd.clear()
        s.peak = None
    whole = _Samples()
    warm = max(warmup - 1, 0)
    for i in range(warm + repeats):
        rec = record if i >= warm else None
        values = _run_pass(
            pieces, inputs, loss, output, clock=clock, frozen=frozen, recompute=False, record=rec
        )
        with _buffers_restored(pieces):
            _run_pass(
                pieces, inputs, loss, output, clock=clock, frozen=frozen, recompute=True, record=rec
            )
        with _buffers_restored(pieces):
            f, b = _whole_pass(pieces, inputs, loss, output, clock)
        if i >= warm + repeats - SPLIT_REPEATS:  # the split pass: the last repeats only
            with _buffers_restored(pieces):
                _run_pass(
                    pieces, inputs, loss, output,
                    clock=clock, frozen=frozen, recompute=False, record=rec, split=True,
                )  # fmt: skip
        if rec is not None:
            whole.fwd.append(f)
            whole.bwd.append(b)
    timings = [s.timing() for s in record]
    units, loss_t = timings[:-1], timings[-1]
    # Closure: a stage recomputes its units under one checkpoint, which costs less than the
    # units' own checkpoints summed (their recomputations and hooks run one call at a time).
    whole_t = whole.timing()
    rf = _close([t.recompute_forward_s or 0.0 for t in units], whole_t.forward_s, call_s[0])
    rb = _close(
        [t.recompute_backward_s or 0.0 for t in units],
        whole_t.backward_s - loss_t.backward_s,
        call_s[1],
    )
    units = [
        t.model_copy(update={"recompute_forward_s": f, "recompute_backward_s": b})
        for t, f, b in zip(units, rf, rb)
    ]
    return SweepResult(units=units, loss=loss_t, values=values)
