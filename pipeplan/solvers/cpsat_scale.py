"""Times as integer *ticks* for the CP-SAT model (:mod:`pipeplan.solvers.cpsat_model`).

Bytes are integers already, so memory is exact.  Times are scaled to integer ticks: with
``S = 2**30 / R`` ticks per second, R the largest sum of stage times over the candidate m
(slowest device, all recompute, every cut paid; :func:`reference_time`), each table entry and
o_j is rounded to the nearest tick (:func:`to_ticks`).  A stage's a_j or s_j then errs by at most
2 ticks (two prefix entries, one cut, o_j), U_j by 1 + h / 2 (two prefix entries, one rounded
constant per shared parameter, h of them), each all-reduce A and the engine's fixed cost per step
by 1/2 and D_j by 2 p, so the scaled objective of any partition is within
``E = 2 (p + m - 1) + 2 p + 3 + h`` ticks of S times its step time (:func:`err_ticks`), and the
plan CP-SAT proves optimal is within ``2 E / S`` seconds of the true optimum (about
``8e-9 (p + m)`` of R).
"""

from __future__ import annotations

import numpy as np

from pipeplan.planner.costmodel import stage_time
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.planner.unitcosts import UnitCosts, unit_costs
from pipeplan.solvers.bounds import stage_offsets
from pipeplan.solvers.request import ResolvedRequest

__all__ = ["STAGE_ERR_TICKS", "TICKS", "cut_times", "err_ticks", "reference_time", "to_ticks"]

#: Ticks in the largest possible sum of stage times (the time scale's resolution).
TICKS = 2**30
STAGE_ERR_TICKS = 2.0
"""Largest rounding error of one stage time, in ticks."""


def err_ticks(p: int, m: int, n_shared: int) -> float:
    """E: how far the scaled objective of any partition can be from S times its step time."""
    return STAGE_ERR_TICKS * (p + m - 1) + 2 * p + 3 + n_shared


def reference_time(request: ResolvedRequest) -> float:
    """R: the largest sum of stage times any partition can have, over the candidate m."""
    profile, cluster, options = request.profile, request.cluster, request.options
    ms = request.microbatches
    s_min = min(d.speed for d in cluster.devices)
    update = request.update
    shared = sum(sp.bytes * len(sp.units) for sp in profile.shared_params)
    worst = update.seconds(sum(u.param_bytes for u in profile.units) + shared) / s_min
    worst += sum(cluster.allreduce_s(sp.bytes) for sp in profile.shared_params)
    worst += cluster.step_overhead_s
    for m in ms:
        c = unit_costs(profile, m)
        comm = sum(cut_times(c, cluster, options))
        extra = sum(stage_offsets(c, cluster, options, recompute=True))
        worst = max(worst, float(2 * c.f.sum() + c.g.sum()) / s_min + comm + extra)
    return worst if worst > 0 else 1.0


def cut_times(costs: UnitCosts, cluster: Cluster, options: PlanOptions) -> list[float]:
    """C at every cut: the round trip across the cut before unit k, k = 0..n (0 at both ends).

    Read from :func:`pipeplan.planner.costmodel.stage_time` (a one-unit first stage ending at k - 1).
    """
    n = costs.n
    if cluster.n_stages < 2:
        return [0.0] * (n + 1)
    return [
        0.0,
        *(stage_time(costs, cluster, options, k - 1, k - 1, 0, False)[2] for k in range(1, n)),
        0.0,
    ]


def to_ticks(values: np.ndarray | list[float], scale: float) -> list[int]:
    """Every value times ``scale``, rounded to the nearest integer."""
    return [int(v) for v in np.rint(np.asarray(values, dtype=np.float64) * scale)]
