"""Run the whole traced graph once, on one micro-batch, and keep the values that cross the cuts.

Building the stages needs, for every value live across a cut, whether it is a tensor (it is
sent) or not (``x.size(0)``, a ``sym_size`` of export: the same for every micro-batch of a
plan, so baked into the stage that consumes it as a constant), and every sent tensor's shape,
dtype and ``requires_grad`` (a ``PipelineStage``'s static metadata).  :func:`probe` records
them from one run of the graph (:func:`pipeplan.runtime.stages.build_stages` calls it).  The
run leaves the model's buffers as they were (a batch-norm batch is not counted) and its
values hold no autograd graph.  A model with tensors on ``meta`` runs on ``meta``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_map

from pipeplan.intake.meta import MetaInterpreter, has_meta
from pipeplan.intake.trace import TracedModel
from pipeplan.runtime.batchnorm import preserved_buffers
from pipeplan.runtime.stage_errors import NodeTracker, StageComputeError, node_failure

__all__ = ["probe"]


class _Recorder(NodeTracker):
    def __init__(self, gm: GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[str, Any] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = out
        return out


class _MetaRecorder(_Recorder, MetaInterpreter):
    """A recorder that runs every node on ``meta`` (a model whose parameters have no storage)."""


def probe(
    traced: TracedModel,
    wanted: set[str],
    inputs: tuple[Tensor, ...],
    unit_of: dict[str, str] | None = None,
    stage_of: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Run the whole graph on ``inputs`` (one micro-batch) and return the ``wanted`` values.

    Runs with autograd on, so each tensor's ``requires_grad`` is what a stage will see; the
    model's buffers are left as they were.  If a node raises, the :class:`StageComputeError`
    names it, its inputs, its unit (``unit_of``: node -> unit) and stage (``stage_of``: unit
    -> stage).  A model with tensors on ``meta`` (:mod:`pipeplan.intake.meta`) runs on ``meta``: the
    values are shapes, dtypes and sizes only.
    """
    rec = (_MetaRecorder if has_meta(traced.gm) else _Recorder)(traced.gm, wanted)
    try:
        with torch.enable_grad(), preserved_buffers(traced.gm):
            rec.run(*inputs)
    except Exception as exc:
        what = "the model on one micro-batch (building the stages)"
        text = node_failure(what, rec, exc, unit_of or {}, stage_of)
        if isinstance(rec, _MetaRecorder):
            text += "; the model is on meta, where a node that needs values fails: --init full"
        raise StageComputeError(text) from exc
    # Leaves, not the probe's autograd graph: a graph that outlives the probe holds every
    # parameter's AccumulateGrad node, and materializing then cannot swap the parameter
    # (``use_count ... got 3``).  Frames kept alive by a reference cycle (fx's ``wrap``, in
    # code it generates for torchvision and timm models, holds its own frame) would keep it.
    return tree_map(_without_graph, rec.values)  # type: ignore[no-any-return]


def _without_graph(value: Any) -> Any:
    """``value`` cut from its autograd graph, keeping ``requires_grad``."""
    if isinstance(value, Tensor) and value.requires_grad:
        return value.detach().requires_grad_(True)
    return value
