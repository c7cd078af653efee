"""Partition solvers: each maps (Profile, Cluster, PlanOptions) to an evaluated Plan.

``SOLVERS`` names them for the command line.  Exact solvers raise
:class:`pipeplan.planner.errors.InfeasiblePlanError` when nothing fits; baselines return a plan marked
infeasible instead, so that comparisons can show how they fail.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.solvers.baselines import solve_params, solve_torchgpipe, solve_uniform
from pipeplan.solvers.dp import solve_dp

__all__ = ["SOLVERS", "Solver", "solve_cpsat", "solve_dp"]

Solver = Callable[[Profile, Cluster, PlanOptions], Plan]


def solve_cpsat(profile: Profile, cluster: Cluster, options: PlanOptions | None = None) -> Plan:
    """:func:`pipeplan.solvers.cpsat.solve_cpsat`, imported on first use (OR-Tools loads slowly)."""
    from pipeplan.solvers.cpsat import solve_cpsat as solve

    return solve(profile, cluster, options)


SOLVERS: dict[str, Solver] = {
    "dp": solve_dp,
    "cpsat": solve_cpsat,
    "uniform": solve_uniform,
    "params": solve_params,
    "torchgpipe": solve_torchgpipe,
}
