"""A partition's stages and Plan under the cost model: what the solvers call before and after.

A solver calls :func:`check_request` before it searches: it rejects requests no partition can
satisfy (more stages than units, a micro-batch count whose size was not profiled, pins out of
range, unit limits that cannot cover the model) with the numbers and the fix.  Whatever the
solver's own model, its answer, stage boundaries and a micro-batch count m, is then evaluated
exactly by :func:`evaluate`: :func:`build_stages` computes each stage's F_j, B_j, C_j, memory
M_j and update U_j with the formulas of :mod:`pipeplan.planner.costmodel`, and the Plan records the
closed-form step time

    T(m) = step_time(t, m, c, k) + R + ``Cluster.step_overhead_s``

(R the updates' tail, :func:`pipeplan.planner.updates.update_tail`) beside the step simulator's
makespan (the replay of torch's action lists, :mod:`pipeplan.planner.replay`; none where torch's
class refuses p and m, as ``Schedule1F1B`` does m < p), the bubble fraction, the throughput
B / T(m), the tied all-reduces and the lower bound.  A plan with a stage over its device's
memory gets the status ``infeasible``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from pipeplan.planner.costmodel import (
    bubble_fraction,
    contention,
    lower_bound,
    stage_memory,
    stage_params,
    stage_recomputes,
    stage_time,
    step_time,
    tied_syncs,
)
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.families import check
from pipeplan.planner.replay import replay_plan
from pipeplan.planner.types import (
    Cluster,
    Device,
    MemoryBreakdown,
    Plan,
    PlanOptions,
    Profile,
    Stage,
)
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.planner.updates import update_cost, update_tail

__all__ = [
    "allowed_starts",
    "build_stages",
    "check_request",
    "evaluate",
    "profile_fields",
    "stage_record",
]


def allowed_starts(options: PlanOptions, n: int) -> np.ndarray:
    """``allowed[b]`` (b = 0..n): a stage may start at unit b (b = n: the end of the last one)."""
    allowed = np.ones(n + 1, dtype=bool)
    if options.allowed_cuts is not None:
        allowed[1:n] = False
        allowed[[b for b in options.allowed_cuts if b < n]] = True
    return allowed


def check_request(profile: Profile, cluster: Cluster, options: PlanOptions) -> None:
    """Reject requests no solver can satisfy, with the numbers and the fix."""
    n, p = profile.n_units, cluster.n_stages
    if options.schedule not in ("gpipe", "1f1b"):
        raise InvalidRequestError(
            f"schedule {options.schedule!r}: this solver plans gpipe and 1f1b under the closed "
            "form; plan the other families with pipeplan.solvers.multichunk.solve_schedule "
            "(pipeplan plan --solver dp --schedule NAME does)"
        )
    if p > n:
        raise InvalidRequestError(
            f"{p} stages but the profile has only {n} units; use --stages {n} or fewer, "
            f"or profile again with --max-stages {p} (auto units are refined until there are "
            f"at least that many, where the graph has the nodes)"
        )
    if options.microbatches is not None:
        unit_costs(profile, options.microbatches)  # raises with the fix
    for unit, stage in options.pinned.items():
        if not 0 <= unit < n or not 0 <= stage < p:
            raise InvalidRequestError(
                f"pin {unit}->{stage} is out of range (units 0..{n - 1}, stages 0..{p - 1})"
            )
    if options.max_units is not None and options.max_units * p < n:
        raise InvalidRequestError(
            f"max_units {options.max_units} x {p} stages < {n} units; raise --max-units"
        )
    if options.min_units * p > n:
        raise InvalidRequestError(
            f"min_units {options.min_units} x {p} stages > {n} units; lower --min-units"
        )
    cuts = options.allowed_cuts
    if cuts is not None:
        if cuts and cuts[-1] >= n:
            raise InvalidRequestError(
                f"allowed cut {cuts[-1]} is past the profile's last unit ({n - 1}); give the "
                f"cuts of this profile"
            )
        if len(cuts) < p - 1:
            raise InvalidRequestError(
                f"{p} stages need {p - 1} cuts but only {len(cuts)} are allowed (at units "
                f"{list(cuts)}); use --stages {len(cuts) + 1} or fewer"
            )


def build_stages(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    boundaries: Sequence[int],
    m: int,
    recompute: Sequence[bool] | None = None,
) -> list[Stage]:
    """Evaluate every stage of the partition whose stages start at 0 and at ``boundaries``;
    stage j recomputes as ``recompute[j]`` says, by default as the policy decides
    (:func:`pipeplan.planner.costmodel.stage_recomputes`)."""
    n, p = profile.n_units, cluster.n_stages
    starts = [0, *boundaries]
    if len(starts) != p or any(b <= a for a, b in pairwise(starts)) or starts[-1] >= n:
        raise InvalidRequestError(
            f"boundaries {list(boundaries)} do not split {n} units into {p} non-empty stages"
        )
    costs = unit_costs(profile, m)
    update = update_cost(profile, options.optimizer, cluster)
    if recompute is not None and len(recompute) != p:
        raise InvalidRequestError(f"recompute {list(recompute)} must name all {p} stages")
    stages = []
    for j, l in enumerate(starts):
        r = (starts[j + 1] if j + 1 < p else n) - 1
        rc = (
            stage_recomputes(costs, cluster, options, l, r, j)
            if recompute is None
            else bool(recompute[j])
        )
        F, B, C = stage_time(costs, cluster, options, l, r, j, rc)
        mem = stage_memory(costs, cluster, options, l, r, j, rc)
        dev = cluster.devices[j]
        update_s = update.seconds(stage_params(costs, l, r)) / dev.speed
        stages.append(stage_record(profile, j, dev, l, r, rc, (F, B, C), update_s, mem, mem.total))
    return stages


def stage_record(
    profile: Profile,
    index: int,
    device: Device,
    first: int,
    last: int,
    recompute: bool,
    times: tuple[float, float, float],
    update_s: float,
    memory: MemoryBreakdown,
    peak_bytes: float,
    split: tuple[float, float] | None = None,
) -> Stage:
    """The Stage record of units ``first..last`` on ``device``: ``times`` its (F, B, C),
    ``split`` its backward's (I, W) where the schedule splits it, feasible where
    ``peak_bytes`` (its own memory's total, or its rank's peak) fits the device."""
    F, B, C = times
    return Stage(
        index=index,
        device=device.name,
        first_unit=first,
        last_unit=last,
        unit_names=tuple(u.name for u in profile.units[first : last + 1]),
        recompute=recompute,
        forward_s=F,
        backward_s=B,
        comm_s=C,
        backward_input_s=None if split is None else split[0],
        backward_weight_s=None if split is None else split[1],
        time_s=F + B + C,
        update_s=update_s,
        memory=memory,
        memory_limit=device.memory_bytes,
        feasible=peak_bytes <= device.memory_bytes,
    )


def profile_fields(profile: Profile, m: int) -> dict[str, Any]:
    """The Plan fields every solver copies from the profile, for m micro-batches."""
    return {
        "model": profile.model,
        "model_kwargs": profile.model_kwargs,
        "profile_fingerprint": profile.fingerprint,
        "graph_fingerprint": profile.graph_fingerprint,
        "tracer": profile.tracer,
        "granularity": profile.granularity,
        "dtype": profile.dtype,
        "profiled_threads": profile.device.threads if profile.device.kind == "cpu" else None,
        "batch_size": profile.batch_size,
        "microbatches": m,
        "microbatch_size": profile.batch_size // m,
        "model_sha256": profile.model_sha256,
        "batch_dependent_layers": profile.batch_dependent_layers,
        "unit_expansions": profile.grouping.expanded if profile.grouping else (),
    }


def evaluate(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    boundaries: Sequence[int],
    m: int,
    *,
    solver: str,
    status: str | None = None,
    gap: float | None = None,
    solve_time_s: float | None = None,
    recompute: Sequence[bool] | None = None,
) -> Plan:
    """The Plan of a given partition and micro-batch count under this cost model (each stage
    recomputing as ``recompute`` says, by default as the policy decides)."""
    stages = build_stages(profile, cluster, options, boundaries, m, recompute)
    times = [s.time_s for s in stages]
    busy = [s.forward_s + s.backward_s for s in stages]
    kappa = contention(cluster, m)
    shared = [(sp.bytes, sp.units) for sp in profile.shared_params]
    syncs = tied_syncs(shared, cluster, [s.first_unit for s in stages])
    T = (
        step_time(times, m, busy, kappa)
        + update_tail(
            [s.update_s for s in stages],
            [s.backward_s for s in stages],
            [s.comm_s for s in stages],
            syncs,
            cluster.update_contention,
        )
        + cluster.step_overhead_s
    )
    feasible = all(s.feasible for s in stages)
    if status is None:
        status = "heuristic"
    if not feasible:
        status = "infeasible"
    plan = Plan(
        **profile_fields(profile, m),
        schedule=options.schedule,  # type: ignore[arg-type]  # check_request: gpipe or 1f1b
        checkpoint=options.checkpoint,
        optimizer=options.optimizer,
        cluster=cluster,
        stages=tuple(stages),
        tied_syncs=tuple(syncs),
        step_time_s=T,
        bubble_fraction=bubble_fraction(times, m, busy, kappa),
        throughput=profile.batch_size / T if T > 0 else 0.0,
        feasible=feasible,
        solver=solver,
        status=status,  # type: ignore[arg-type]
        gap=gap,
        lower_bound_s=lower_bound(profile, cluster, options),
        solve_time_s=solve_time_s,
    )
    if check(options.schedule, cluster.n_stages, 1, m) is not None:
        return plan
    simulated = replay_plan(plan, timeline=False).makespan_s
    return plan.model_copy(update={"simulated_step_time_s": simulated})
