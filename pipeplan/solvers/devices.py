"""Plan for N devices: pipeline depth p times d = N / p data-parallel ranks, in either mode.

A user has N identical devices and a global batch B (``global_batch``; the profile's batch
when not given).  For every depth p that divides N (and p <= units) and every data-parallel
mode (``replicate``: whole copies; ``shard``: FSDP2, :mod:`pipeplan.planner.collectives`), the
d = N / p ranks of each stage take B / d of the batch each; the family, v, m, the cuts and the
recomputation are chosen for that share by a solver (:func:`pipeplan.solvers.choose.solve`,
every schedule family under ``auto``) on a cluster whose ``data_parallel`` is d in that mode.
The profile's per-micro-batch measurements are reused: m = B / (d b) for a profiled
micro-batch size b that divides B / d.  The replicas run at once and the gradient collectives
close the step (in each stage's update tail), so the global step takes the replica's T, and
the throughput is B / T.

The per-(p, mode) optimum is the solver's; the choice over p and the mode is an enumeration
(:func:`plan_devices` returns every pair, best first).  Exact wherever the solver is.

Layout: replica r's rank j (its stage, or its chunks) is global rank r p + j, a pipeline's
ranks consecutive (``Plan.layout``): the runtime's device mesh of shape (d, p), dimensions
(dp, pp), as torchtitan orders them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pipeplan.planner.errors import InfeasiblePlanError, InvalidRequestError
from pipeplan.planner.types import Cluster, Device, Plan, PlanOptions, Profile

__all__ = ["MODES", "DeviceChoice", "Mode", "layout", "plan_devices", "replica_profile"]

Solver = Callable[[Profile, Cluster, PlanOptions], Plan]


Mode = Literal["replicate", "shard"]

#: The data-parallel modes :func:`plan_devices` tries by default.
MODES: tuple[Mode, ...] = ("replicate", "shard")


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """One pipeline depth in one data-parallel mode: its plan, or why it has none."""

    stages: int
    replicas: int
    plan: Plan | None
    reason: str = ""
    """Why there is no plan (empty when there is one)."""
    mode: Mode = "replicate"

    @property
    def throughput(self) -> float:
        """Global samples per second (0 without a plan)."""
        return 0.0 if self.plan is None else self.plan.throughput * self.replicas


def layout(stages: int, replicas: int) -> tuple[tuple[int, ...], ...]:
    """Global ranks of each replica's stages: replica r's stage j on rank r * stages + j.

    >>> layout(2, 3)
    ((0, 1), (2, 3), (4, 5))
    """
    return tuple(tuple(r * stages + j for j in range(stages)) for r in range(replicas))


def replica_profile(profile: Profile, replicas: int, global_batch: int | None = None) -> Profile:
    """The profile of one replica's share: batch B / d (B the ``global_batch``, else the
    profile's), the profiled micro-batch sizes that divide it.

    Raises :class:`InvalidRequestError` when d does not divide B or no profiled size divides
    B / d."""
    batch = profile.batch_size if global_batch is None else global_batch
    if batch < 1:
        raise InvalidRequestError(f"global batch {batch} must be at least 1 sample")
    if batch % replicas:
        raise InvalidRequestError(
            f"global batch {batch} does not split over {replicas} data-parallel ranks; give a "
            f"multiple of {replicas}"
        )
    share = batch // replicas
    sizes = tuple(b for b in profile.microbatch_sizes if share % b == 0)
    if not sizes:
        raise InvalidRequestError(
            f"no profiled micro-batch size divides the replica's batch {share} (profiled: "
            f"{list(profile.microbatch_sizes)}); give a global batch that d times one of them "
            "divides, or profile --microbatch-sizes that divide it"
        )
    return profile.model_copy(update={"batch_size": share, "microbatch_sizes": sizes})


def plan_devices(
    profile: Profile,
    devices: int,
    cluster: Cluster,
    options: PlanOptions,
    solver: Solver,
    global_batch: int | None = None,
    modes: Sequence[Mode] = MODES,
    replicas: int | None = None,
) -> list[DeviceChoice]:
    """Every depth p dividing ``devices`` (only p = devices / ``replicas`` when that is given)
    in each of ``modes``: the best plan of d = devices / p data-parallel ranks per stage, best
    throughput first (then replicate before shard, then fewer stages; pairs without a plan
    last, by p).  With d = 1 the modes coincide, and only ``replicate`` is planned.

    ``cluster`` describes one device (its first) and the links: each depth gets p copies of
    that device, ``data_parallel`` d in the mode, and the cluster's links and engine terms.
    """
    if devices < 1:
        raise InvalidRequestError(f"--devices {devices} must be at least 1")
    if replicas is not None and (replicas < 1 or devices % replicas):
        raise InvalidRequestError(
            f"--dp {replicas} does not divide --devices {devices}; give a divisor of {devices}"
        )
    if not cluster.uniform_speed or len({d.memory_bytes for d in cluster.devices}) > 1:
        raise InvalidRequestError(
            "--devices needs identical devices; give the cluster one speed and one memory size"
        )
    device = cluster.devices[0]
    depths = [p for p in range(1, devices + 1) if devices % p == 0]
    if replicas is not None:
        depths = [devices // replicas]
    out = []
    for p in depths:
        d = devices // p
        for mode in modes if d > 1 else modes[:1]:
            out.append(
                _one_depth(profile, p, d, mode, device, cluster, options, solver, global_batch)
            )
    order = {m: k for k, m in enumerate(MODES)}
    return sorted(out, key=lambda c: (c.plan is None, -c.throughput, order[c.mode], c.stages))


def _one_depth(
    profile: Profile,
    p: int,
    d: int,
    mode: Mode,
    device: Device,
    cluster: Cluster,
    options: PlanOptions,
    solver: Solver,
    global_batch: int | None,
) -> DeviceChoice:
    def none(reason: str) -> DeviceChoice:
        return DeviceChoice(p, d, None, reason, mode)

    if p > profile.n_units:
        return none(f"more stages than the {profile.n_units} units")
    cuts = options.allowed_cuts
    if cuts is not None and len(cuts) < p - 1:
        return none(f"only {len(cuts)} allowed cut(s) (--for)")
    try:
        share = replica_profile(profile, d, global_batch)
    except InvalidRequestError as exc:
        return none(str(exc).split(";")[0])
    clus = cluster.model_copy(
        update={
            "devices": tuple(device.model_copy(update={"name": f"dev{j}"}) for j in range(p)),
            "data_parallel": d,
            "data_parallel_mode": mode,
        }
    )
    try:
        plan = solver(share, clus, options)
    except (InfeasiblePlanError, InvalidRequestError) as exc:
        return none(str(exc).split(";")[0])
    if not plan.feasible:
        return none("no partition fits in memory")
    return DeviceChoice(
        p, d, plan.model_copy(update={"layout": layout(plan.pipeline_ranks, d)}), "", mode
    )
