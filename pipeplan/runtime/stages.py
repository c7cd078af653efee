"""Cut a traced model at a plan's unit boundaries into one module per pipeline stage.

Stage j runs the nodes of units ``first_unit..last_unit``.  It receives *everything* live
across its input cut and sends *everything* live across its output cut
(:func:`pipeplan.intake.graph.cut_tensors`), so a residual or skip connection that jumps over a stage
is forwarded through it: every stage talks only to its neighbours.

    stage 0      inputs = the model's inputs           outputs = live across cut after it
    stage j      inputs = live across cut before it    outputs = live across cut after it
    stage p - 1  inputs = live across cut before it    outputs = the model's output

Values that cross a cut but are not tensors (``x.size(0)``, a ``sym_size`` of export) are
the same for every micro-batch of a plan (all micro-batches have size b), so they are recorded
once, by running the whole graph on one micro-batch (:mod:`pipeplan.runtime.probe`), and
baked into the stage that consumes them as constants.  The same run gives every sent
tensor's shape, dtype and ``requires_grad``, which
:class:`torch.distributed.pipelining.PipelineStage` takes as static metadata (no shape
inference on garbage data).

Parameters are never sent: ``pipeplan.intake.graph`` copies each ``get_attr`` next to its users, so a
parameter used on two stages (a tied embedding and LM head) appears in both stage modules as
the same object.  :func:`tied_parameters` finds them; :mod:`pipeplan.runtime.gradsync` sums
their gradients across the ranks that hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.node import map_arg
from torch.utils._pytree import (
    TreeSpec,
    tree_flatten,
    tree_unflatten,
)

from pipeplan.intake.graph import UnitSpec, cut_tensors, subgraph_module
from pipeplan.intake.trace import TracedModel
from pipeplan.planner.errors import FingerprintMismatchError, InvalidRequestError
from pipeplan.planner.families import FAMILIES, check
from pipeplan.planner.types import Plan
from pipeplan.runtime.probe import probe
from pipeplan.runtime.stage_errors import (
    NodeTracker,
    StageComputeError,
    exception_text,
    node_failure,
)

__all__ = [
    "StageModule",
    "StageProgram",
    "TiedParameter",
    "build_stages",
    "check_plan",
    "check_schedule",
    "parameter_names",
    "retarget_devices",
    "tied_parameters",
]


@dataclass(frozen=True, slots=True)
class _Const:
    value: Any


class StageModule(nn.Module):
    """One stage's nodes as a module: tensors in, tensors out.

    ``body`` takes every value live across the input cut positionally; ``slots`` says, for
    each, whether it is the next received tensor or a :class:`_Const`.  Non-last stages return
    only the tensor outputs, in order, each contiguous and none a view (:func:`_sendable`;
    a transposed view or a slice may cross a cut).  The last stage returns the *tensor leaves*
    of the model's output (:func:`torch.utils._pytree.tree_flatten`: nested tuples, lists,
    dicts and ``transformers`` ``ModelOutput`` s), because the pipeline engine hands a stage's
    output to autograd as a flat tuple of tensors; :meth:`rebuild_output` puts the model's
    output back together for the loss.  Received tensors pass through
    :class:`_ContiguousGrad`, so the gradients sent back are contiguous too.

    ``unit_of`` maps a graph node to its unit's name: when the body raises, the stage runs the
    micro-batch again node by node to name the unit, node and values that failed
    (:class:`~pipeplan.runtime.stage_errors.StageComputeError`).

    With ``detached`` (the zero-bubble families), torch detaches a stage's outputs in place
    once their input gradient is made (``stage_backward_input``), before the weight gradient
    that still needs what the stage saved.  An output that a node of the same stage also read
    (a residual stream that a LayerNorm there normalised and saved for its weight's gradient)
    would then be a saved tensor detached in place, which autograd refuses: such outputs are
    sent as a copy, one more activation-sized tensor per micro-batch in flight.  (A result
    that only its own op saved, a ReLU's, is fine: that op's backward runs in the input
    gradient, before the detach.)
    """

    def __init__(
        self,
        body: GraphModule,
        slots: Sequence[_Const | None],
        sent: Sequence[int],
        root_graph: Graph,
        *,
        first: bool,
        output_template: Any = None,
        index: int = 0,
        unit_of: dict[str, str] | None = None,
        detached: bool = False,
    ) -> None:
        super().__init__()
        self.body = body
        out_node = next(n for n in body.graph.nodes if n.op == "output")
        self._read_here = (
            tuple(k for k, n in enumerate(out_node.args[0]) if _read_inside(n, out_node))
            if detached
            else None
        )
        """Positions of the body's outputs that its own nodes read too (zero-bubble only)."""
        self._slots = tuple(slots)
        self._sent = tuple(sent)
        self._root_graph = root_graph
        self._first = first
        self._template = output_template
        self._index = index
        self._unit_of = dict(unit_of or {})
        self._out_spec: TreeSpec | None = None
        self._out_consts: dict[int, Any] = {}

    @property
    def received(self) -> tuple[bool, ...]:
        """For each of ``body``'s inputs, whether it is a received tensor (not a constant)."""
        return tuple(s is None for s in self._slots)

    def body_inputs(self, *args: Any) -> list[Any]:
        """What ``body`` takes for the stage's received ``args``: every value live across
        the input cut, the constants put in."""
        if self._first:
            args = tuple(self._root_graph.process_inputs(*args))
        else:
            args = tuple(_ContiguousGrad.apply(a) if _needs_grad(a) else a for a in args)
        received = iter(args)
        return [next(received) if s is None else s.value for s in self._slots]

    def forward(self, *args: Any) -> Any:
        full = self.body_inputs(*args)
        try:
            outs = self.body(*full)
        except _PASS_THROUGH:  # checkpoint's early stop of a recomputation: control flow
            raise
        except Exception as exc:
            raise self._locate(full, exc) from exc
        read = set() if self._read_here is None else {id(outs[k]) for k in self._read_here}
        if self._template is None:
            return tuple(self._detachable(_sendable(outs[i]), read) for i in self._sent)
        leaves, spec = tree_flatten(self._model_output(outs))
        self._out_spec = spec
        self._out_consts = {k: v for k, v in enumerate(leaves) if not isinstance(v, Tensor)}
        return tuple(self._detachable(v, read) for v in leaves if isinstance(v, Tensor))

    def _detachable(self, t: Tensor, read: set[int]) -> Tensor:
        """``t``, or a copy where torch's in-place detach would break this stage's backward."""
        return t.clone() if id(t) in read and t.requires_grad and not t._is_view() else t

    def _model_output(self, outs: Sequence[Any]) -> Any:
        values = dict(zip(self._template[1], outs))
        result = _thaw(map_arg(self._template[0], lambda n: values[n.name]))
        return self._root_graph.process_outputs(result)

    def rebuild_output(self, tensors: Sequence[Tensor]) -> Any:
        """The model's output (its structure and non-tensor values) from the last stage's
        tensors; the identity on anything else."""
        if self._out_spec is None:
            return tensors
        it = iter(tensors)
        n = self._out_spec.num_leaves
        leaves = [self._out_consts[k] if k in self._out_consts else next(it) for k in range(n)]
        return tree_unflatten(leaves, self._out_spec)

    def _locate(self, full: Sequence[Any], exc: Exception) -> Exception:
        """Run the body node by node to find the node that raises ``exc``'s error."""
        if isinstance(exc, StageComputeError):
            return exc
        tracker = NodeTracker(self.body)
        try:
            with torch.set_grad_enabled(torch.is_grad_enabled()):
                tracker.run(*full)
        except Exception:  # noqa: BLE001 - the node is what we want, not the error
            return StageComputeError(
                node_failure(f"stage {self._index}", tracker, exc, self._unit_of)
            )
        return StageComputeError(  # the node-by-node rerun passed: no node to name
            f"stage {self._index}: {exception_text(exc)} (a rerun node by node did not fail)"
        )


def _sendable(t: Tensor) -> Tensor:
    """``t`` contiguous and not a view: a transport sends contiguous buffers, and torch's
    zero-bubble backward (``stage_backward_input``) detaches a stage's outputs in place, which a
    view refuses (a value that passes through the stage is a view of what it received)."""
    t = t.contiguous()
    return t.clone() if t._is_view() else t


def _read_inside(node: Node, out_node: Node) -> bool:
    """Whether a node of the body other than its output reads ``node``'s value."""
    return any(user is not out_node for user in node.users)


def _thaw(value: Any) -> Any:
    """fx's ``immutable_dict`` and ``immutable_list`` (what ``map_arg`` builds) as the ``dict``
    and ``list`` that the model's generated code returns."""
    if isinstance(value, immutable_dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, immutable_list):
        return [_thaw(v) for v in value]
    if type(value) is tuple:
        return tuple(_thaw(v) for v in value)
    return value


try:  # raised by non-reentrant checkpointing to end a recomputation early
    from torch.utils.checkpoint import _StopRecomputationError as _PASS_THROUGH
except ImportError:  # pragma: no cover - older torch

    class _PASS_THROUGH(Exception):  # type: ignore[no-redef]
        pass


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the backward makes the gradient contiguous (it is sent to a peer)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _needs_grad(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


@dataclass(frozen=True, slots=True)
class StageProgram:
    """A stage module plus example tensors of one micro-batch for static metadata."""

    index: int
    module: StageModule
    inputs: tuple[str, ...]
    """Names of the tensors the stage receives (stage 0: the model's inputs)."""
    outputs: tuple[str, ...]
    """Names of the tensors it sends (empty for the last stage)."""
    example_inputs: tuple[Tensor, ...]
    example_outputs: tuple[Tensor, ...]


@dataclass(frozen=True, slots=True)
class TiedParameter:
    """A parameter that two or more stages use; its gradient is summed over ``stages``."""

    name: str
    stages: tuple[int, ...]


def check_plan(plan: Plan, traced: TracedModel, units: Sequence[UnitSpec]) -> None:
    """Raise :class:`FingerprintMismatchError` unless ``plan`` was made for this graph."""
    if plan.graph_fingerprint != traced.fingerprint:
        raise FingerprintMismatchError(
            f"plan was made for graph fingerprint {plan.graph_fingerprint} ({plan.model}, "
            f"{plan.tracer}) but this model traces to {traced.fingerprint} ({traced.tracer}); "
            f"profile and plan this model again, or pass the model the plan was made for"
        )
    last = plan.stages[-1].last_unit if plan.stages else -1
    if last + 1 != len(units):
        raise FingerprintMismatchError(
            f"plan covers {last + 1} units but the model groups into {len(units)} units "
            f"(granularity {plan.granularity!r}); profile and plan it again"
        )
    expected = 0
    for s in plan.stages:
        if s.first_unit != expected or s.last_unit < s.first_unit:
            raise InvalidRequestError(
                f"plan stage {s.index} covers units {s.first_unit}..{s.last_unit}; stages must "
                f"be non-empty and contiguous from unit 0 (expected first unit {expected})"
            )
        have = tuple(u.name for u in units[s.first_unit : s.last_unit + 1])
        if have != tuple(s.unit_names):
            diff = next(i for i, (a, b) in enumerate(zip(have, s.unit_names)) if a != b)
            unit = s.first_unit + diff
            raise FingerprintMismatchError(
                f"stage {s.index}: plan names unit {unit} {s.unit_names[diff]!r} but the model's "
                f"unit {unit} is {have[diff]!r}; profile and plan this model again"
            )
        expected = s.last_unit + 1


def _example(value: Tensor) -> Tensor:
    """A contiguous CPU tensor like ``value``: the pipeline allocates its receive buffers from
    these, and a transport receives into contiguous buffers only (a meta value keeps the
    strides of a transposed view that crosses a cut; ``zeros_like`` would copy them)."""
    if value.is_meta:
        t = torch.zeros(value.shape, dtype=value.dtype)
    else:
        t = value.detach().contiguous()
    return t.requires_grad_(value.requires_grad and t.is_floating_point())


def _retarget(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device) and value != device:
        return device
    if type(value) in (tuple, list):
        return type(value)(_retarget(v, device) for v in value)
    return value


def retarget_devices(gm: GraphModule, device: torch.device) -> None:
    """Make the graph create tensors on ``device``.

    A graph traced on one device can hold that device as a literal (export writes
    ``arange(..., device=cpu)``; a ``x.device`` that crosses a cut is baked in as a constant);
    running the stage elsewhere needs them rewritten.
    """
    for node in gm.graph.nodes:
        node.args = _retarget(node.args, device)
        node.kwargs = {k: _retarget(v, device) for k, v in node.kwargs.items()}
    gm.recompile()


def build_stages(
    plan: Plan,
    traced: TracedModel,
    units: Sequence[UnitSpec],
    example_inputs: tuple[Tensor, ...],
    device: torch.device | None = None,
) -> list[StageProgram]:
    """One :class:`StageProgram` per plan stage; the stages share the model's parameters.

    ``example_inputs`` is one micro-batch of the model's inputs (size ``plan.microbatch_size``)
    on the device the model is on.  With ``device``, the stage graphs create their tensors
    there instead (:func:`retarget_devices`); the modules are not moved.
    """
    check_plan(plan, traced, units)
    gm = traced.gm
    cuts = cut_tensors(traced, list(units))
    placeholders = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_names = tuple(dict.fromkeys(n.name for n in out_node.all_input_nodes))
    p = plan.n_stages
    bounds = [
        (placeholders if j == 0 else cuts[s.first_unit - 1], cuts[s.last_unit] if j < p - 1 else ())
        for j, s in enumerate(plan.stages)
    ]
    wanted = {name for io in bounds for side in io for name in side} | set(out_names)
    unit_of = {n: u.name for u in units for n in u.nodes}
    stage_of = {u: s.index for s in plan.stages for u in s.unit_names}
    values = probe(traced, wanted, example_inputs, unit_of, stage_of)

    programs = []
    for j, s in enumerate(plan.stages):
        ins, outs = bounds[j]
        nodes = [n for u in units[s.first_unit : s.last_unit + 1] for n in u.nodes]
        last = j == p - 1
        body = subgraph_module(traced, nodes, ins, out_names if last else outs)
        slots = [None if isinstance(values[i], Tensor) else _Const(values[i]) for i in ins]
        if device is not None:
            retarget_devices(body, device)
            slots = [s if s is None else _Const(_retarget(s.value, device)) for s in slots]
        sent = [k for k, name in enumerate(outs) if isinstance(values[name], Tensor)]
        module = StageModule(
            body,
            slots,
            sent,
            gm.graph,
            first=j == 0,
            output_template=(out_node.args[0], out_names) if last else None,
            index=j,
            unit_of=unit_of,
            detached=FAMILIES[plan.schedule].split_backward,
        )
        if j == 0:
            recv = placeholders
        else:
            recv = tuple(i for i, slot in zip(ins, slots) if slot is None)
        send = tuple(outs[k] for k in sent)
        if last:
            out_values = tree_flatten(module._model_output([values[n] for n in out_names]))[0]
        else:
            out_values = [values[n] for n in send]
        programs.append(
            StageProgram(
                index=j,
                module=module,
                inputs=recv,
                outputs=send,
                example_inputs=(
                    tuple(_example(values[n]) for n in recv) if j else tuple(example_inputs)
                ),
                example_outputs=tuple(_example(v) for v in out_values if isinstance(v, Tensor)),
            )
        )
    return programs


def _stage_parameters(stage: nn.Module) -> dict[int, nn.Parameter]:
    return {id(p): p for p in stage.parameters()}


def parameter_names(root: nn.Module, *extra: nn.Module) -> dict[int, str]:
    """``id(parameter) -> qualified name``: the first name under which ``root`` (then each of
    ``extra``) holds it, so a tied parameter has one name everywhere."""
    names: dict[int, str] = {}
    for module in (root, *extra):
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
    return names


def tied_parameters(
    stages: Sequence[nn.Module], names: dict[int, str] | None = None
) -> list[TiedParameter]:
    """Parameters held by two or more of ``stages`` (all of the plan's stages, in order).

    Named by ``names`` (``id -> name``, see :func:`parameter_names`), by default as in the
    traced graph.
    """
    owners: dict[int, list[int]] = {}
    for j, stage in enumerate(stages):
        for pid in _stage_parameters(stage):
            owners.setdefault(pid, []).append(j)
    names = names or parameter_names(*(getattr(s, "body", s) for s in stages))
    return sorted(
        (TiedParameter(names[pid], tuple(js)) for pid, js in owners.items() if len(js) > 1),
        key=lambda t: (t.stages, t.name),
    )


def check_schedule(plan: Plan) -> None:
    """Reject micro-batch counts the schedule cannot run, naming the fix."""
    if plan.microbatch_size * plan.microbatches != plan.batch_size:
        raise InvalidRequestError(
            f"plan splits batch {plan.batch_size} into {plan.microbatches} micro-batches of "
            f"{plan.microbatch_size}; make the plan again"
        )
    p, v = plan.pipeline_ranks, plan.stages_per_rank
    if p * v != plan.n_stages:
        raise InvalidRequestError(
            f"plan has {plan.n_stages} stages, not a multiple of its {v} chunks per rank; "
            "make the plan again"
        )
    why = check(plan.schedule, p, v, plan.microbatches) if v > 1 else None
    if why is not None:
        raise InvalidRequestError(f"torch refuses the plan's schedule: {why}; plan again")
    if plan.schedule == "1f1b" and plan.microbatches < plan.n_stages:
        raise InvalidRequestError(
            f"1F1B needs at least as many micro-batches as stages ({plan.microbatches} < "
            f"{plan.n_stages}); plan with --schedule gpipe or --microbatches {plan.n_stages}"
        )
