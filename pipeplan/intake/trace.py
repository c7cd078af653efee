"""Trace a model into one ``torch.fx`` graph that the profiler and the runtime share.

:func:`trace_model` turns an ``nn.Module`` into a ``torch.fx.GraphModule``, by
``torch.fx.symbolic_trace`` or, when that fails (data-dependent Python, Hugging Face models), by
``torch.export.export(strict=False)`` with a dynamic batch dimension.  The graph is then
normalised: every ``get_attr`` node (a parameter or buffer) is copied next to each of its users,
so a parameter never crosses a cut, and export's input-guard call is dropped.  The result carries
a fingerprint of the graph's structure, which a plan records so the runtime can check that it
rebuilds the graph the plan was made from.

:mod:`pipeplan.intake.graph` groups the traced nodes into units and finds what crosses each cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import logging
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.fx import Graph, GraphModule, Node

from pipeplan.planner.errors import InvalidRequestError, TraceError

__all__ = ["TracedModel", "get_attr", "run_eagerly", "trace_model"]

TracerName = Literal["fx", "export"]


@dataclass(frozen=True)
class TracedModel:
    """A traced model: ``gm(*inputs) == module(*inputs)``."""

    gm: GraphModule
    """For ``fx`` its submodules and parameters are the original module's objects."""
    tracer: TracerName
    fingerprint: str
    """Hash of the graph's structure (node names, ops, targets, parameter shapes); it does not
    depend on the batch size, the device or the process.  An fx graph's does not depend on the
    dtype either; an export graph's can (a model's own casts, such as an RMSNorm computing in
    float32, are traced as nodes only where they change the dtype), so profile in the dtype you
    will run."""


def _one_line(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Tracer(torch.fx.Tracer):
    """``torch.fx``'s tracer, keeping the type of a ``dataclass`` dict (a ``transformers``
    ``ModelOutput``): fx records any dict as a plain dict, so the loss would get a dict where the
    model returns ``output.logits``.  Like fx's own namedtuples, it becomes a node that calls
    the class with the values as keywords."""

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and dataclasses.is_dataclass(a) and not isinstance(a, type):
            kwargs = {str(k): self.create_arg(v) for k, v in a.items()}
            return self.create_node("call_function", type(a), (), kwargs)
        return super().create_arg(a)


def _trace_fx(module: nn.Module, n_inputs: int) -> GraphModule:
    """``symbolic_trace``, with the forward's optional arguments past the ``n_inputs`` given
    fixed at their defaults (``forward(x, mask=None)`` called as ``forward(x)``)."""
    fixed = _defaults_after(module, n_inputs)
    tracer = _Tracer()
    graph = tracer.trace(module, concrete_args=fixed or None)
    gm = GraphModule(tracer.root, graph, type(module).__name__)
    if fixed:
        for node in [n for n in gm.graph.nodes if n.op == "placeholder"][n_inputs:]:
            for user in list(node.users):
                _erase_check(gm.graph, user)
            if not node.users:
                gm.graph.erase_node(node)
        gm.recompile()
    return gm


def _erase_check(graph: Graph, node: Node) -> None:
    """Erase fx's check that a fixed argument kept its value: ``_assert_is_none(x)`` for a
    ``None`` default, ``_assert(eq(x, value))`` for any other (``is_causal=False``)."""
    if node.target is torch.fx._symbolic_trace._assert_is_none and not node.users:
        graph.erase_node(node)
    elif node.target is operator.eq and all(u.target is torch._assert for u in node.users):
        for user in list(node.users):
            if not user.users:
                graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


def _defaults_after(module: nn.Module, n_inputs: int) -> dict[str, Any]:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return {}
    return {p.name: p.default for p in positional[n_inputs:] if p.default is not p.empty}


def _trace_export(module: nn.Module, example_inputs: tuple[Tensor, ...]) -> GraphModule:
    from torch.export import Dim

    dim = getattr(Dim, "DYNAMIC", None) or getattr(Dim, "AUTO", None)
    per_input = tuple({0: dim} for _ in example_inputs)
    # A forward(x, y) takes one spec per argument; a forward(*args) one tuple for the varargs.
    for dynamic in (per_input, (per_input,)) if dim is not None else ():
        try:
            ep = torch.export.export(module, example_inputs, strict=False, dynamic_shapes=dynamic)
            return ep.module()  # type: ignore[return-value]
        except Exception:  # noqa: BLE001, S112 - try the next structure, then a static batch
            continue
    ep = torch.export.export(module, example_inputs, strict=False)
    return ep.module()  # type: ignore[return-value]


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Torch's loggers at ERROR and stderr kept aside for the block: a failing
    ``torch.export`` logs and prints its partial graphs (some 65 lines for one data-dependent
    ``if``), and the one-line error says what matters (``--debug`` shows the traceback)."""
    names = [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _normalise(gm: GraphModule) -> None:
    """Drop export's input guard and copy each ``get_attr`` node before each of its users."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        users = sorted(node.users, key=_position(graph).__getitem__)
        if not users:
            graph.erase_node(node)
            continue
        users[0].prepend(node)
        for user in users[1:]:
            with graph.inserting_before(user):
                copy = graph.get_attr(str(node.target))
            copy.meta = dict(node.meta)
            user.replace_input_with(node, copy)
    graph.lint()
    gm.recompile()


def _position(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _describe(value: Any, index: dict[Node, int]) -> Any:
    """A JSON-able, process-independent description of a node argument."""
    if isinstance(value, Node):
        return f"%{index[value]}"
    if isinstance(value, (tuple, list)):
        return [_describe(v, index) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v, index) for k, v in sorted(value.items(), key=str)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, slice):
        return ["slice", *(_describe(v, index) for v in (value.start, value.stop, value.step))]
    if isinstance(value, torch.device):
        return "<device>"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return "<dtype>" if isinstance(value, torch.dtype) else str(value)
    return f"<{type(value).__name__}>"


def _target_name(node: Node) -> str:
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return str(node.target)
        return torch.fx.node._get_qualified_name(node.target)  # type: ignore[arg-type]
    return str(node.target)


def _shape(node: Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, Tensor):
        return [d if isinstance(d, int) else "?" for d in val.shape]
    return None


def _fingerprint(gm: GraphModule) -> str:
    index = _position(gm.graph)
    rows: list[Any] = []
    for node in gm.graph.nodes:
        row: list[Any] = [node.name, node.op, _target_name(node)]
        row.append(_describe(node.args, index))
        row.append(_describe(node.kwargs, index))
        if node.op == "get_attr":
            attr = get_attr(gm, str(node.target))
            row.append(list(attr.shape) if isinstance(attr, Tensor) else type(attr).__name__)
        elif node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            row.append(type(sub).__qualname__)
            row.append([[k, list(p.shape)] for k, p in sub.named_parameters()])
        else:
            row.append(_shape(node))
        rows.append(row)
    text = json.dumps(rows, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def get_attr(gm: GraphModule, target: str) -> Any:
    """The parameter, buffer or submodule a ``get_attr`` node's dotted ``target`` names."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def run_eagerly(module: nn.Module, example_inputs: tuple[Tensor, ...]) -> None:
    """Run ``module`` once outside any tracer: a :class:`~pipeplan.planner.errors.UserCodeError` naming
    the user's file and line if its ``forward`` raises by itself."""
    from pipeplan.intake.usercode import model_name, user_code

    with torch.no_grad(), user_code(f"the model's forward ({model_name(module)})"):
        module(*example_inputs)


def trace_model(
    module: nn.Module,
    example_inputs: tuple[Tensor, ...],
    tracer: Literal["auto", "fx", "export"] = "auto",
) -> TracedModel:
    """Trace ``module`` into a GraphModule: fx first, then export (``tracer="auto"``).

    >>> traced = trace_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    >>> traced.tracer, [n.op for n in traced.gm.graph.nodes]
    ('fx', ['placeholder', 'call_module', 'call_module', 'output'])
    """
    if tracer not in ("auto", "fx", "export"):
        raise InvalidRequestError(f"tracer {tracer!r} is not one of 'auto', 'fx', 'export'")
    from pipeplan.intake.usercode import model_name, user_location

    name = model_name(module)
    errors: list[str] = []
    branches: list[str] = []  # where a tracer met control flow on a tensor's value
    gm: GraphModule | None = None
    used: TracerName = "fx"
    if tracer in ("auto", "fx"):
        try:
            gm = _trace_fx(module, len(example_inputs))
        except Exception as exc:  # noqa: BLE001 - any tracer failure is reported
            errors.append(f"torch.fx failed ({_one_line(exc)})")
            if "control flow" in str(exc):
                branches.append(user_location(exc, user_only=True) or "")
    if gm is None and tracer in ("auto", "export"):
        try:
            with _quiet_export():
                gm, used = _trace_export(module, tuple(example_inputs)), "export"
        except Exception as exc:  # noqa: BLE001 - any tracer failure is reported
            at = user_location(exc, user_only=True)
            errors.append(f"torch.export failed{f' at {at}' if at else ''} ({_one_line(exc)})")
            if "DataDependent" in type(exc).__name__:
                branches.append(at or "")
    if gm is None:
        run_eagerly(module, example_inputs)  # the user's forward itself may be what fails
        if branches and len(branches) == (2 if tracer == "auto" else 1):
            at = next((b for b in reversed(branches) if b), "")
            raise TraceError(
                f"cannot trace {name}: its forward branches on a tensor's value"
                f"{f' at {at}' if at else ''}; compute that condition outside the model, or "
                "use torch.where / torch.cond"
            )
        hint = (
            "make forward() free of data-dependent Python control flow, or try --tracer export"
            if tracer == "fx"
            else "make forward() free of data-dependent control flow and Python side effects "
            "(for Hugging Face models pass use_cache=False)"
        )
        raise TraceError(f"cannot trace {name}: {'; '.join(errors)}; {hint}")
    _normalise(gm)
    return TracedModel(gm=gm, tracer=used, fingerprint=_fingerprint(gm))
