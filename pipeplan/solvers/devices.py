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
Floor = Callable[[Profile, Cluster, PlanOptions], float]


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
    floor: Floor | None = None,
    quick: Solver | None = None,
    refine: int = 0,
) -> list[DeviceChoice]:
    """Every depth p dividing ``devices`` (only p = devices / ``replicas`` when that is given)
    in each of ``modes``: the best plan of d = devices / p data-parallel ranks per stage, best
    throughput first (then replicate before shard, then fewer stages; pairs without a plan
    last, by p).  With d = 1 the modes coincide, and only ``replicate`` is planned.

    ``cluster`` describes one device (its first) and the links: each depth gets p copies of
    that device, ``data_parallel`` d in the mode, and the cluster's links and engine terms.

    With ``floor`` (a lower bound on the step of every plan ``solver`` could return, e.g.
    :func:`pipeplan.solvers.multichunk.schedule_floor`), the pairs are solved in increasing
    order of their floor, and a pair whose floor is no less than the best step found so far is
    not searched: every pair has the same global batch, so it cannot have the best
    throughput.  Such a pair gets ``quick``'s plan (e.g. the DP's one-chunk plan) for the
    frontier, or none; the best pair is the same as without ``floor``.

    With ``refine`` = r > 0 (for the schedule solver, whose local search is what costs), the
    search is spent where it can matter.  First every pair is planned from the search's seeds
    alone (``options.search_work`` = 0: the DP's plans, the balanced and min-max cuts, every
    (family, v, m) scored, and the exhaustive enumeration where it is small); then the r pairs
    with the fastest such plans, whose floor is still below the best step, are searched again
    with ``options``' budget.  The search of one pair costs about as much as the seeds of all
    of them (7B profile, 512 devices: 20 pairs), so the planning time is about (r + 1) searches
    instead of one per pair.  The other pairs keep their seeds' plan, which their status and
    gap describe.
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
    out: list[DeviceChoice] = []
    todo: list[tuple[float, int, Profile, Cluster, Mode]] = []
    for p in depths:
        d = devices // p
        for mode in modes if d > 1 else modes[:1]:
            got = _request(profile, p, d, mode, device, cluster, options, global_batch)
            if isinstance(got, str):
                out.append(DeviceChoice(p, d, None, got, mode))
                continue
            share, clus = got
            bound = floor(share, clus, options) if floor is not None else 0.0
            todo.append((bound, p, share, clus, mode))
    best = float("inf")
    if not 0 < refine < len(todo):  # every pair would be searched: search each once
        refine = 0
    first = options.model_copy(update={"search_work": 0}) if refine else options
    searched: list[tuple[float, int, float, Profile, Cluster, Mode]] = []
    for bound, p, share, clus, mode in sorted(todo, key=lambda t: (t[0], t[1], t[4])):
        use = solver if bound < best else quick
        choice = _solve(
            share, clus, first, use, p, mode, f"bound {bound:.4g} s >= best {best:.4g} s"
        )
        if use is solver and choice.plan is not None:
            best = min(best, _step(choice.plan))
            searched.append((_step(choice.plan), len(out), bound, share, clus, mode))
        out.append(choice)
    for _, at, bound, share, clus, mode in sorted(searched, key=lambda t: (t[0], t[1]))[:refine]:
        if bound >= best:
            continue
        again = _solve(share, clus, options, solver, out[at].stages, mode, "")
        if again.plan is not None and _step(again.plan) <= _step(out[at].plan):  # type: ignore[arg-type]
            out[at] = again
            best = min(best, _step(again.plan))
    order = {m: k for k, m in enumerate(MODES)}
    return sorted(out, key=lambda c: (c.plan is None, -c.throughput, order[c.mode], c.stages))


def _step(plan: Plan) -> float:
    """The step a plan is ranked by: its simulated step where it has one."""
    return plan.simulated_step_time_s or plan.step_time_s


def _request(
    profile: Profile,
    p: int,
    d: int,
    mode: Mode,
    device: Device,
    cluster: Cluster,
    options: PlanOptions,
    global_batch: int | None,
) -> tuple[Profile, Cluster] | str:
    """The replica's profile and the cluster of one (p, d, mode), or why it has no plan."""
    if p > profile.n_units:
        return f"more stages than the {profile.n_units} units"
    cuts = options.allowed_cuts
    if cuts is not None and len(cuts) < p - 1:
        return f"only {len(cuts)} allowed cut(s) (--for)"
    try:
        share = replica_profile(profile, d, global_batch)
    except InvalidRequestError as exc:
        return str(exc).split(";")[0]
    clus = cluster.model_copy(
        update={
            "devices": tuple(device.model_copy(update={"name": f"dev{j}"}) for j in range(p)),
            "data_parallel": d,
            "data_parallel_mode": mode,
        }
    )
    return share, clus


def _solve(
    share: Profile,
    clus: Cluster,
    options: PlanOptions,
    solver: Solver | None,
    p: int,
    mode: Mode,
    skipped: str,
) -> DeviceChoice:
    d = clus.data_parallel
    if solver is None:
        return DeviceChoice(p, d, None, f"not searched: {skipped}", mode)
    try:
        plan = solver(share, clus, options)
    except (InfeasiblePlanError, InvalidRequestError) as exc:
        return DeviceChoice(p, d, None, str(exc).split(";")[0], mode)
    if not plan.feasible:
        return DeviceChoice(p, d, None, "no partition fits in memory", mode)
    return DeviceChoice(
        p, d, plan.model_copy(update={"layout": layout(plan.pipeline_ranks, d)}), "", mode
    )
