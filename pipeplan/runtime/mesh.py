"""The device mesh of a plan's ranks: FSDP2 on its data-parallel axis, TP inside its stages.

What runs where.  A plan of p pipeline ranks, d data-parallel replicas and t tensor-parallel
ranks per stage (``Cluster.tensor_parallel``) runs on p d t ranks: replica r's pipeline rank j
on global ranks (r p + j) t + k, k = 0..t-1 (``Plan.layout``).  That is torch's
:func:`~torch.distributed.device_mesh.init_device_mesh` of shape (d, p, t), dimensions
(dp, pp, tp), tp innermost (consecutive ranks, one node), as torchtitan and Megatron-LM order
them; with t = 1 the mesh is (d, p) and with d = t = 1 there is none (the default group is
the pipeline).

- **pp**: the pipeline's sends and receives run on the pp dimension's group, so tp rank k of
  stage j talks to tp rank k of stages j - 1 and j + 1 only (each sends its replicated
  activation, and its replicated gradient back).
- **tp**: each stage module is split over the tp dimension with torch's
  ``parallelize_module`` by the model's layout (:func:`tensor_parallel_styles`,
  :mod:`pipeplan.intake.tp_stages`): attention and MLP projections column- then row-wise,
  one all-reduce per sub-block forward and backward.  Embeddings, norms and the head stay
  replicated on the t ranks in this first version (no vocabulary-parallel head, no sequence
  parallel).
- **dp**: gradients are averaged over the dp dimension's group
  (:mod:`pipeplan.runtime.gradsync`), each tp rank with its own shard's replicas; or, with
  ``Cluster.data_parallel_mode == "shard"``, each stage module (each chunk,
  recomputing wrapper included) is wrapped in :func:`torch.distributed.fsdp.fully_shard` over
  the dp dimension with ``reshard_after_forward=False``: torchtitan's policy when it
  pipelines (with t > 1, over parameters that TP made DTensors on the tp dimension already:
  FSDP2's own 2-D composition).  torch's ``PipelineStage`` recognises the ``FSDPModule`` and accumulates
  unsharded gradients over the micro-batches, then reduce-scatters (averaging over the d
  ranks) once, after the step's last backward (:mod:`pipeplan.planner.collectives` models
  exactly this).

Nothing of FSDP or TP is re-implemented here: pipeplan chooses the degrees and the cuts, torch
runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.fx import GraphModule

from pipeplan.intake.tp_layout import Style
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Plan

if TYPE_CHECKING:
    from pipeplan.intake.tp_sequence import SequenceRole

__all__ = [
    "PlanMesh",
    "plan_mesh",
    "shard_stage_modules",
    "split_stage_modules",
    "tensor_parallel_styles",
]


@dataclass(frozen=True, slots=True)
class PlanMesh:
    """This rank's groups: ``None`` everywhere for one pipeline (the default group is the
    pipeline)."""

    pp_group: Any = None
    dp_group: Any = None
    dp_mesh: Any = None
    """The dp dimension's 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` (FSDP's)."""
    tp_mesh: Any = None
    """The tp dimension's 1-D mesh (``parallelize_module``'s), ``None`` for t = 1."""
    tp_rank: int = 0
    """This rank's index k on the tp dimension."""


def plan_mesh(plan: Plan, device: torch.device) -> PlanMesh:
    """The (dp, pp, tp) device mesh of ``plan`` (module docstring); collective: every rank
    calls it.  Raises :class:`InvalidRequestError` when the plan's layout is not the
    runtime's."""
    d, p, t = plan.cluster.data_parallel, plan.pipeline_ranks, plan.cluster.tensor_parallel
    if d == 1 and t == 1:
        return PlanMesh()
    expected = tuple(tuple((r * p + j) * t for j in range(p)) for r in range(d))
    if plan.layout and plan.layout != expected:
        raise InvalidRequestError(
            f"the plan's layout {plan.layout} is not the runtime's (replica r's rank j on ranks "
            f"(r * {p} + j) * {t} + k); plan again with --devices"
        )
    from torch.distributed.device_mesh import init_device_mesh

    if t == 1:
        mesh = init_device_mesh(device.type, (d, p), mesh_dim_names=("dp", "pp"))
        return PlanMesh(mesh.get_group("pp"), mesh.get_group("dp"), mesh["dp"])
    mesh = init_device_mesh(device.type, (d, p, t), mesh_dim_names=("dp", "pp", "tp"))
    return PlanMesh(
        mesh.get_group("pp"),
        mesh.get_group("dp") if d > 1 else None,
        mesh["dp"] if d > 1 else None,
        mesh["tp"],
        mesh["tp"].get_local_rank(),
    )


def tensor_parallel_styles(module: nn.Module, t: int) -> dict[str, Style]:
    """The tensor-parallel styles of ``module``'s linears by their qualified names in
    ``module`` (:func:`pipeplan.intake.tp_layout.find_layout`, looking inside
    pipeplan's ``NamedInputs`` wrapper for the model's config).  Raises
    :class:`InvalidRequestError` in one line when the model has no layout, or ``t`` does not
    divide its heads, KV heads or split features (:func:`check_degree`)."""
    from pipeplan.intake.spec import NamedInputs
    from pipeplan.intake.tp_layout import check_degree, find_layout

    inner, prefix = (module.model, "model.") if isinstance(module, NamedInputs) else (module, "")
    layout = find_layout(inner)
    if isinstance(layout, str):
        raise InvalidRequestError(
            f"the plan asks for --tensor-parallel {t} but {type(inner).__name__} has no "
            f"tensor-parallel layout: {layout}; plan --tensor-parallel 1"
        )
    check_degree(layout, t)
    return {prefix + name: style for name, style in layout.styles.items()}


def split_stage_modules(
    bodies: Sequence[tuple[GraphModule, Sequence[Any], SequenceRole | None, bool]],
    modules: Sequence[nn.Module],
    mesh: PlanMesh,
    styles: dict[str, Style],
    names: dict[int, str],
    root: nn.Module,
) -> dict[int, str]:
    """Split each stage body (with the values one micro-batch passes it, its role for
    sequence parallelism where the plan has it, and whether the loss reads its logits split)
    over ``mesh``'s tp dimension by ``styles``
    (:func:`pipeplan.intake.tp_stages.split_stage_body`; collective over the tp group).  The split linears' parameters become
    :class:`~torch.distributed.tensor.DTensor` parameters, so ``names`` (parameter id -> the
    model's qualified name) is returned for the rank's ``modules`` as they are now, and each
    new parameter is put in ``root`` (the user's model) under its name too, where the rank's
    weights are read from for a save (:func:`pipeplan.runtime.weights.shard_tensors`; an
    exported graph holds its own reference to each parameter, not the model's module)."""
    from pipeplan.intake.tp_stages import split_stage_body
    from pipeplan.runtime.batchnorm import preserved_buffers

    by_path = _paths(modules, names)
    for body, example, sequence, loss_parallel in bodies:
        with preserved_buffers(body):  # the split runs the body once: leave no trace of it
            split_stage_body(body, styles, mesh.tp_mesh, example, sequence, loss_parallel)
    return {**names, **_renamed(modules, by_path, root)}


def _paths(modules: Sequence[nn.Module], names: dict[int, str]) -> list[dict[str, str]]:
    """Each module's parameters: path in the module -> the model's qualified name."""
    return [
        {path: names[id(prm)] for path, prm in module.named_parameters() if id(prm) in names}
        for module in modules
    ]


def _renamed(
    modules: Sequence[nn.Module], by_path: list[dict[str, str]], root: nn.Module | None
) -> dict[int, str]:
    """``id -> name`` of the parameters ``modules`` hold now (``by_path``: recorded before
    torch replaced them), each also put in ``root`` under its name where ``root`` holds one
    there: a save reads the rank's weights from the user's model
    (:func:`pipeplan.runtime.weights.shard_tensors`), and an exported graph holds its own
    reference to each parameter, not the model's module."""
    out: dict[int, str] = {}
    for module, paths in zip(modules, by_path, strict=True):
        for path, prm in module.named_parameters():
            if path not in paths:
                continue
            out[id(prm)] = paths[path]
            if root is None:
                continue
            owner, _, leaf = paths[path].rpartition(".")
            holder = root.get_submodule(owner) if owner else root
            if leaf in holder._parameters and holder._parameters[leaf] is not prm:
                holder._parameters[leaf] = prm
    return out


def shard_stage_modules(
    modules: Sequence[nn.Module],
    mesh: PlanMesh,
    names: dict[int, str],
    root: nn.Module | None = None,
) -> dict[int, str]:
    """Wrap each of this rank's stage modules in ``fully_shard`` over ``mesh``'s dp dimension
    (module docstring).  ``fully_shard`` replaces every parameter by a sharded
    :class:`~torch.distributed.tensor.DTensor` parameter, so ``names`` (parameter id -> the
    model's qualified name) is returned for the new parameters (put in ``root`` too, as
    :func:`split_stage_modules` does).  On top of tensor parallelism this is FSDP2's 2-D
    composition: ``fully_shard`` over dp of parameters that are DTensors over tp already.

    Raises :class:`InvalidRequestError` when two modules of the rank share a parameter (a
    tied embedding and head in a V's two chunks): FSDP2 manages a parameter in one module
    only."""
    from torch.distributed.fsdp import fully_shard

    seen: dict[int, int] = {}
    for k, module in enumerate(modules):
        for prm in module.parameters():
            if seen.setdefault(id(prm), k) != k:
                raise InvalidRequestError(
                    f"parameter {names.get(id(prm), '?')} is held by two chunks of one rank, "
                    "which FSDP2 cannot shard; plan --data-parallel replicate, or a schedule "
                    "that puts the tied ends on different ranks"
                )
    by_path = _paths(modules, names)
    for module in modules:
        fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False)
    return _renamed(modules, by_path, root)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (shares its storage), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
