"""Pipeline partitioning with CP-SAT (OR-Tools), with the constraints the DP cannot take.

Devices may differ in speed and memory, units may be pinned to stages, and stages may be bounded
in units.  For each micro-batch count m, :class:`pipeplan.solvers.cpsat_model.CpsatModel` states the
partition as a CP-SAT model over the stage boundaries (the formulation is in its module
docstring), with times scaled to integer ticks (:mod:`pipeplan.solvers.cpsat_scale`, which bounds the
rounding error: :func:`error_bound_s`).  This module solves those models and keeps the best
plan; the returned plan is always re-evaluated exactly by :func:`pipeplan.planner.evaluate.evaluate`.

One model per m rather than one model with m as a choice: every unit's costs change with the
micro-batch size, so a joint model would hold |m| copies of every table plus the product
(m - 1) T, whose linearisation is weak.  Separate models are small, and each one after the first
gets the incumbent as a cutoff (``objective <= best - 1``), so a hopeless m is refuted quickly;
an m whose closed-form lower bound (:func:`pipeplan.planner.costmodel.lower_bound` per m) cannot beat the
incumbent is skipped outright.

Bounds and hints (:mod:`pipeplan.solvers.bounds`).  Stage compute times (no communication) are monotone
interval costs.  The greedy "longest stage within T" on the cheapest per-unit cost, plus
bisection, gives the compute-only min-max T_lb (a lower bound of max_j t_j, and a floor on T);
the same greedy on the stages' own costs gives a partition to hint.  With an incumbent of step time
U, any better partition has max_j t_j <= (U - S_lb) / (m - 1), S_lb = sum_u min_j (unit u's
compute on device j); greedy reach forward and backward under that threshold bounds every b_j
(the *window*), which shrinks the element tables from O(n) values to a few.

Complexity.  Each model is small (:mod:`pipeplan.solvers.cpsat_model`); the search is exponential in the
worst case.  200 units x 16 stages x 8 micro-batch counts are proven optimal in about a second on
two cores (see ``benchmarks/solvers``).

Time limits.  ``options.time_limit_s`` bounds the wall-clock time over all m; a plan found but
not proven has status ``"feasible"`` and ``gap = (objective - bound) / objective`` in ticks (if
time runs out before CP-SAT's first solution, the greedy partition is kept when it fits).  When
no partition fits, a second search without memory limits (a second time budget) finds the memory
the best partition needs.  The search uses two workers and a fixed seed; the optimum is
reproducible, though with two threads the choice between equally good partitions may in
principle depend on timing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
from ortools.sat.python import cp_model

from pipeplan.planner.errors import InfeasiblePlanError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.solvers.bounds import Bounds
from pipeplan.solvers.cpsat_model import CpsatModel
from pipeplan.solvers.cpsat_scale import STAGE_ERR_TICKS, TICKS, err_ticks, reference_time
from pipeplan.solvers.request import ResolvedRequest, resolve_request

__all__ = ["CpsatResult", "error_bound_s", "partition_cpsat", "solve_cpsat"]


@dataclass(frozen=True, slots=True)
class CpsatResult:
    """The best partition found, with what was proven about it."""

    starts: tuple[int, ...]
    """First unit of every stage (``starts[0] == 0``)."""
    m: int
    optimal: bool
    gap: float
    """(objective - best bound) / objective, in ticks; 0 when proven optimal."""
    objective_ticks: int
    scale: float
    """Ticks per second."""
    per_m_status: dict[int, str] = field(default_factory=dict)


def error_bound_s(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    """Seconds by which a plan CP-SAT proves optimal may exceed the true optimum."""
    req = ResolvedRequest(profile, cluster, options)
    R = reference_time(req)
    return (
        2
        * err_ticks(cluster.n_stages, max(req.microbatches), len(profile.shared_params))
        * R
        / TICKS
    )


def partition_cpsat(
    profile: Profile, cluster: Cluster, options: PlanOptions, *, ignore_memory: bool = False
) -> CpsatResult | None:
    """The best (starts, m) CP-SAT finds; ``None`` when it proves that no partition fits.

    Raises :class:`InfeasiblePlanError` when the time limit ends the search before a feasible
    partition is found.
    """
    req = resolve_request(profile, cluster, options)
    deadline = None if options.time_limit_s is None else time.monotonic() + options.time_limit_s
    scale = TICKS / reference_time(req)
    p = cluster.n_stages
    if ignore_memory:
        cluster = _unlimited(cluster)
    caps = [d.memory_bytes for d in cluster.devices]
    order = []
    for m in req.microbatches:
        c = unit_costs(profile, m)
        order.append((Bounds(c, cluster, options), c))
    order.sort(key=lambda item: (item[0].lower_bound(), item[0].m))
    best: tuple[float, int, tuple[int, ...], int] | None = None  # (step s, ticks, starts, m)
    bounds: list[float] = []
    status_of: dict[int, str] = {}
    proven = True
    for bd, c in order:
        m = bd.m
        err = err_ticks(p, m, len(profile.shared_params))
        lb_ticks = bd.lower_bound() * scale - err
        if best is not None and bd.lower_bound() >= best[0]:
            status_of[m] = "pruned"
            continue
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            status_of[m] = "not started"
            bounds.append(lb_ticks)
            proven = False
            # Out of time before this m: with no plan yet, keep its greedy partition if it fits.
            hint_s = _satisfies(req, cluster, bd.hint, m) if best is None else None
            if hint_s is not None:
                best = (hint_s, math.ceil(hint_s * scale + err), bd.hint, m)
            continue
        hint_s = _satisfies(req, cluster, bd.hint, m)
        incumbent = min(best[0] if best is not None else math.inf, hint_s or math.inf)
        window = bd.window(bd.t_max(incumbent)) if math.isfinite(incumbent) else None
        t_floor = math.floor(bd.t_lb * scale - STAGE_ERR_TICKS)
        model = CpsatModel(c, req, cluster, scale, caps, window, bd.hint, t_floor)
        status, solver = model.solve(left, None if best is None else best[1] - 1)
        status_of[m] = solver.status_name(status).lower()
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            obj = round(solver.objective_value)
            starts = model.starts(solver)
            if best is None or obj < best[1]:
                exact = evaluate(profile, cluster, options, starts[1:], m, solver="cpsat")
                true_ticks = exact.step_time_s * scale
                if true_ticks > obj + 2 * err:
                    # Several shared parameters (the model charged each all-reduce alone), or
                    # updates that slow each other: a lower bound.  Keep obj as the bound and
                    # the true time as the incumbent, if it is better than the one before.
                    proven = False
                    bounds.append(obj)
                    obj = math.ceil(true_ticks + err)
                if best is None or obj < best[1]:
                    best = (exact.step_time_s, obj, starts, m)
        elif (
            status == cp_model.UNKNOWN and hint_s is not None and hint_s < (best or (math.inf,))[0]
        ):
            # Out of time before CP-SAT's first solution: keep the greedy one, with its ticks
            # rounded up by the scaling error so that the cutoff excludes nothing better.
            best = (hint_s, math.ceil(hint_s * scale + err), bd.hint, m)
        if status in (cp_model.FEASIBLE, cp_model.UNKNOWN):
            proven = False
            bounds.append(max(lb_ticks, solver.best_objective_bound))
        elif status == cp_model.MODEL_INVALID:  # pragma: no cover - a bug in this module
            raise RuntimeError(f"CP-SAT rejected the model: {model.model.validate()}")
        # OPTIMAL, or INFEASIBLE: nothing fits or nothing beats the cutoff; proven either way.
    if best is None:
        if not proven:
            raise InfeasiblePlanError(
                f"CP-SAT found no partition of {profile.n_units} units into {p} stages within "
                f"--time-limit {options.time_limit_s} s; raise --time-limit"
            )
        return None
    _, obj, starts, m = best
    bound = min([obj, *bounds])
    gap = 0.0 if proven or obj <= 0 else max(0.0, (obj - bound) / obj)
    return CpsatResult(starts, m, proven, gap, obj, scale, status_of)


def _satisfies(
    req: ResolvedRequest, cluster: Cluster, starts: tuple[int, ...], m: int
) -> float | None:
    """The step time of a partition that meets every constraint on ``cluster`` (the
    request's, or it without memory limits), else ``None``."""
    profile, options = req.profile, req.options
    sizes = np.diff([*starts, profile.n_units])
    if sizes.min() < options.min_units or sizes.max() > (options.max_units or profile.n_units):
        return None
    if not req.allowed[list(starts)].all():
        return None
    for unit, stage in options.pinned.items():
        if (
            not starts[stage]
            <= unit
            < (starts[stage + 1] if stage + 1 < len(starts) else profile.n_units)
        ):
            return None
    plan = evaluate(profile, cluster, options, starts[1:], m, solver="cpsat")
    return plan.step_time_s if plan.feasible else None


def solve_cpsat(profile: Profile, cluster: Cluster, options: PlanOptions | None = None) -> Plan:
    """The step-time-optimal feasible plan (``status="feasible"`` if the time limit hit first).

    Devices may differ in speed and memory; ``options.pinned``, ``min_units`` and ``max_units``
    constrain the stages.  Raises :class:`InfeasiblePlanError` with the memory the best
    unconstrained partition needs when no partition fits.

    >>> from pipeplan.profiler.synthetic import synthetic_profile
    >>> prof = synthetic_profile(8, batch_size=8, microbatch_sizes=[1, 2, 4, 8])
    >>> plan = solve_cpsat(prof, Cluster.homogeneous(2, 2**40), PlanOptions(pinned={7: 1}))
    >>> (plan.n_stages, plan.status, plan.stages[1].last_unit)
    (2, 'optimal', 7)
    """
    options = options or PlanOptions()
    t0 = time.perf_counter()
    found = partition_cpsat(profile, cluster, options)
    elapsed = time.perf_counter() - t0
    if found is None:
        _raise_infeasible(profile, cluster, options)
    status = "optimal" if found.optimal else "feasible"
    return evaluate(
        profile,
        cluster,
        options,
        found.starts[1:],
        found.m,
        solver="cpsat",
        status=status,
        gap=None if found.optimal else found.gap,
        solve_time_s=elapsed,
    )


def _unlimited(cluster: Cluster) -> Cluster:
    devices = tuple(d.model_copy(update={"memory_bytes": 2**62}) for d in cluster.devices)
    return cluster.model_copy(update={"devices": devices})


def _raise_infeasible(profile: Profile, cluster: Cluster, options: PlanOptions) -> NoReturn:
    """Re-solve without memory limits (a second time budget) and report what that plan needs."""
    have = min(d.memory_bytes for d in cluster.devices)
    free = partition_cpsat(profile, cluster, options, ignore_memory=True)
    where = f"{profile.n_units} units into {cluster.n_stages} stages"
    if free is None:
        raise InfeasiblePlanError(
            f"no partition of {where} satisfies the pins and unit counts; relax them"
        )
    plan = evaluate(profile, _unlimited(cluster), options, free.starts[1:], free.m, solver="cpsat")
    need = max(s.memory.total for s in plan.stages)
    raise InfeasiblePlanError(
        f"no partition of {where} fits in {format_bytes(have)} per device; the best partition "
        f"needs {format_bytes(need)} (--memory {need}), or add stages, checkpoint more, or use "
        f"fewer micro-batches",
        min_memory_bytes=need,
    )
