"""Partition solvers: each maps (Profile, Cluster, PlanOptions) to an evaluated Plan.

``SOLVERS`` names them for the command line.  Exact solvers raise
:class:`planner.errors.InfeasiblePlanError` when nothing fits; baselines return a plan marked
infeasible instead, so that comparisons can show how they fail.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.types import Cluster, Plan, PlanOptions, Profile
from solvers.dp import solve_dp

__all__ = ["SOLVERS", "Solver", "solve_dp"]

Solver = Callable[[Profile, Cluster, PlanOptions], Plan]

SOLVERS: dict[str, Solver] = {"dp": solve_dp}
