"""The device mesh of a plan's ranks, and FSDP2 on its data-parallel axis.

A plan of p pipeline ranks and d data-parallel ranks per stage runs on p d ranks, rank
r p + j running replica r's pipeline rank j (``Plan.layout``): torch's
:func:`~torch.distributed.device_mesh.init_device_mesh` of shape (d, p), dimensions
(dp, pp), as torchtitan orders them.  The pipeline's sends and receives run on the pp
dimension's group; the data-parallel collectives on the dp dimension's.

With ``Cluster.data_parallel_mode == "shard"`` each stage module (each chunk, recomputing
wrapper included) is wrapped in :func:`torch.distributed.fsdp.fully_shard` over the dp
dimension with ``reshard_after_forward=False``: torchtitan's policy when it pipelines.
torch's ``PipelineStage`` recognises the ``FSDPModule`` and accumulates unsharded gradients
over the micro-batches, then reduce-scatters (averaging over the d ranks) once, after the
step's last backward (:mod:`pipeplan.planner.collectives` models exactly this).  Nothing of
FSDP is re-implemented here: pipeplan chooses the degrees and the cuts, torch runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Plan

__all__ = ["PlanMesh", "plan_mesh", "shard_stage_modules"]


@dataclass(frozen=True, slots=True)
class PlanMesh:
    """This rank's groups: ``None`` everywhere for one pipeline (the default group is the
    pipeline)."""

    pp_group: Any = None
    dp_group: Any = None
    dp_mesh: Any = None
    """The dp dimension's 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` (FSDP's)."""


def plan_mesh(plan: Plan, device: torch.device) -> PlanMesh:
    """The (dp, pp) device mesh of ``plan`` (module docstring); collective: every rank calls
    it.  Raises :class:`InvalidRequestError` when the plan's layout is not the runtime's."""
    d, p = plan.cluster.data_parallel, plan.pipeline_ranks
    if d == 1:
        return PlanMesh()
    expected = tuple(tuple(r * p + j for j in range(p)) for r in range(d))
    if plan.layout and plan.layout != expected:
        raise InvalidRequestError(
            f"the plan's layout {plan.layout} is not the runtime's (replica r's rank j on rank "
            f"r * {p} + j); plan again with --devices"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (d, p), mesh_dim_names=("dp", "pp"))
    return PlanMesh(mesh.get_group("pp"), mesh.get_group("dp"), mesh["dp"])


def shard_stage_modules(
    modules: Sequence[nn.Module], mesh: PlanMesh, names: dict[int, str]
) -> dict[int, str]:
    """Wrap each of this rank's stage modules in ``fully_shard`` over ``mesh``'s dp dimension
    (module docstring).  ``fully_shard`` replaces every parameter by a sharded
    :class:`~torch.distributed.tensor.DTensor` parameter, so ``names`` (parameter id -> the
    model's qualified name) is returned for the new parameters.

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
    by_path = [
        {path: names[id(prm)] for path, prm in module.named_parameters() if id(prm) in names}
        for module in modules
    ]
    for module in modules:
        fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False)
    out: dict[int, str] = {}
    for module, paths in zip(modules, by_path, strict=True):
        for path, prm in module.named_parameters():
            if path in paths:
                out[id(prm)] = paths[path]
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (shares its storage), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
