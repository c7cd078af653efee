"""Plan for N devices: pipeline depth p times data-parallel replicas d = N / p.

A user has N identical devices and a global batch B.  For every depth p that divides N (and
p <= units, B divisible by d), the d = N / p replicas of a p-stage pipeline each take B / d of
the batch; m and the cuts are chosen for that share by a solver (the DP by default), on a
cluster whose ``data_parallel`` is d, so each stage's update is preceded by the ring
all-reduce of its gradients over the d replicas (:func:`pipeplan.planner.updates.update_cost`).  The
replicas run at once and the all-reduce closes the step, so the global step takes the
replica's T(m), and the throughput is B / T(m).

The per-p optimum is the solver's; the choice over p is an enumeration
(:func:`plan_devices` returns every p, best first).  Exact wherever the solver is.

Layout: replica r's stage j runs on global rank r p + j, a pipeline's stages on consecutive
ranks (``Plan.layout``), the runtime's device mesh of shape (d, p), dimensions (dp, pp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeplan.planner.errors import InfeasiblePlanError, InvalidRequestError
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile

__all__ = ["DeviceChoice", "layout", "plan_devices", "replica_profile"]

Solver = Callable[[Profile, Cluster, PlanOptions], Plan]


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """One pipeline depth: its plan, or why it has none."""

    stages: int
    replicas: int
    plan: Plan | None
    reason: str = ""
    """Why there is no plan (empty when there is one)."""

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


def replica_profile(profile: Profile, replicas: int) -> Profile:
    """The profile of one replica's share: batch B / d, the micro-batch sizes that divide it.

    Raises :class:`InvalidRequestError` when d does not divide B or no profiled size divides
    B / d."""
    batch = profile.batch_size
    if batch % replicas:
        raise InvalidRequestError(f"batch {batch} does not split over {replicas} replicas")
    share = batch // replicas
    sizes = tuple(b for b in profile.microbatch_sizes if share % b == 0)
    if not sizes:
        raise InvalidRequestError(
            f"no profiled micro-batch size divides the replica's batch {share} (profiled: "
            f"{list(profile.microbatch_sizes)})"
        )
    return profile.model_copy(update={"batch_size": share, "microbatch_sizes": sizes})


def plan_devices(
    profile: Profile,
    devices: int,
    cluster: Cluster,
    options: PlanOptions,
    solver: Solver,
) -> list[DeviceChoice]:
    """Every depth p dividing ``devices``: the best plan of d = devices / p replicas, best
    throughput first (depths without a plan last, by p).

    ``cluster`` describes one device (its first) and the links: each depth gets p copies of
    that device, ``data_parallel`` d, and the cluster's links and engine terms.
    """
    if devices < 1:
        raise InvalidRequestError(f"--devices {devices} must be at least 1")
    if not cluster.uniform_speed or len({d.memory_bytes for d in cluster.devices}) > 1:
        raise InvalidRequestError(
            "--devices needs identical devices; give the cluster one speed and one memory size"
        )
    device = cluster.devices[0]
    out = []
    for p in (p for p in range(1, devices + 1) if devices % p == 0):
        d = devices // p
        if p > profile.n_units:
            out.append(DeviceChoice(p, d, None, f"more stages than the {profile.n_units} units"))
            continue
        cuts = options.allowed_cuts
        if cuts is not None and len(cuts) < p - 1:
            out.append(DeviceChoice(p, d, None, f"only {len(cuts)} allowed cut(s) (--for)"))
            continue
        try:
            share = replica_profile(profile, d)
        except InvalidRequestError as exc:
            out.append(DeviceChoice(p, d, None, str(exc)))
            continue
        clus = cluster.model_copy(
            update={
                "devices": tuple(device.model_copy(update={"name": f"dev{j}"}) for j in range(p)),
                "data_parallel": d,
            }
        )
        try:
            plan = solver(share, clus, options)
        except InfeasiblePlanError as exc:
            out.append(DeviceChoice(p, d, None, str(exc).split(";")[0]))
            continue
        if not plan.feasible:
            out.append(DeviceChoice(p, d, None, "no partition fits in memory"))
            continue
        out.append(DeviceChoice(p, d, plan.model_copy(update={"layout": layout(p, d)})))
    return sorted(out, key=lambda c: (c.plan is None, -c.throughput, c.stages))
