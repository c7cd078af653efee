"""A stage's failure, named: which stage, unit and node raised, on what values.

When a stage's body raises, :class:`~pipeplan.runtime.stages.StageModule` runs the micro-batch
again node by node on a :class:`NodeTracker`, which remembers the node it is running and
every value so far; :func:`node_failure` then names the unit and node that raised, the op, and
its inputs' shapes, dtypes and layouts (:func:`describe_values`), as a
:class:`StageComputeError`.  The probe that builds the stages
(:func:`pipeplan.runtime.probe.probe`) and the model's loss (:mod:`pipeplan.runtime.loss`)
name their failures the same way.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.fx import GraphModule, Interpreter, Node
from torch.utils._pytree import keystr, tree_flatten_with_path

from pipeplan.planner.errors import PipeplanError

__all__ = [
    "NodeTracker",
    "StageComputeError",
    "describe_values",
    "exception_text",
    "node_failure",
    "rank_label",
]


class StageComputeError(PipeplanError, RuntimeError):
    """A stage's computation raised; the message names the stage, unit, node and its inputs."""


class NodeTracker(Interpreter):
    """An interpreter that remembers the node it is running and every value so far."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.current: Node | None = None
        self.extra_traceback = False  # the error as raised, without the graph's dump

    def run_node(self, n: Node) -> Any:
        self.current = n
        return super().run_node(n)


def _describe_value(value: Any) -> str:
    if isinstance(value, Tensor):
        layout = "" if value.is_contiguous() else ", non-contiguous"
        dtype = str(value.dtype).removeprefix("torch.")
        return f"tensor {tuple(value.shape)} {dtype}{layout}"
    return type(value).__name__ if not isinstance(value, (int, float, bool)) else repr(value)


def describe_values(tree: Any, limit: int = 6) -> str:
    """``tree`` for an error message: a tensor's shape, dtype and layout; a container's type
    and its first ``limit`` leaves by pytree path (``dict {['out']: tensor (2, 4) float32}``)."""
    leaves, _ = tree_flatten_with_path(tree)
    if len(leaves) == 1 and not leaves[0][0]:
        return _describe_value(leaves[0][1])
    parts = [f"{keystr(path)}: {_describe_value(v)}" for path, v in leaves[:limit]]
    more = f", ... {len(leaves) - limit} more" if len(leaves) > limit else ""
    return f"{type(tree).__name__} {{{', '.join(parts)}{more}}}"


def exception_text(exc: BaseException) -> str:
    """``Type: message`` on one line, the message cut at 400 characters."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


def node_failure(
    where: str,
    tracker: NodeTracker,
    exc: BaseException,
    unit_of: dict[str, str],
    stage_of: dict[str, int] | None = None,
) -> str:
    """``where, [stage,] unit, node (target) on (its inputs): the error``, from a tracker
    that raised (``unit_of``: node -> unit; ``stage_of``: unit -> stage)."""
    node = tracker.current
    if node is None:
        return f"{where}: {exception_text(exc)}"
    args = ", ".join(_describe_value(tracker.env.get(a)) for a in node.all_input_nodes)
    unit = unit_of.get(node.name, "?")
    if stage_of is not None:
        where = f"{where}: stage {stage_of.get(unit, '?')}"
    return f"{where}, unit {unit!r}, node {node.name} ({_target(node)}) on ({args}): {exception_text(exc)}"


def _target(node: Node) -> str:
    target = node.target
    return str(target) if isinstance(target, str) else getattr(target, "__name__", str(target))


def rank_label(rank: int, held: list[int]) -> str:
    """How a message names a rank: ``stage 1 (rank 1)``, or ``rank 0 (stages 0 and 3)`` for a
    rank that holds several chunks of a multi-chunk plan (``held``: its stages)."""
    if len(held) == 1:
        return f"stage {held[0]} (rank {rank})"
    return f"rank {rank} (stages {', '.join(map(str, held[:-1]))} and {held[-1]})"
