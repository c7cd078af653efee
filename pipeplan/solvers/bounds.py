"""Compute-only stage tables and bounds for the CP-SAT model of :mod:`pipeplan.solvers.cpsat`.

``stage_compute`` is stage j's prefix table of per-unit compute time on device j (recompute
included, communication left out) and ``stage_offsets`` what :func:`pipeplan.planner.costmodel.stage_time`
adds per stage (the engine's cost per operation, the loss on the last stage).  A stage's compute
time is then a lower bound of its t_j, and :class:`Bounds` turns that into the bounds and the
hint the CP-SAT search uses: S_lb (a lower bound of sum_j t_j), T_lb (a lower bound of
max_j t_j), the window every boundary b_j must lie in for a threshold, and a greedy partition.
"""

from __future__ import annotations

import numpy as np

from pipeplan.planner.costmodel import recomputes, stage_time
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.planner.unitcosts import UnitCosts

__all__ = ["Bounds", "stage_backward", "stage_compute", "stage_offsets"]


def _recomputes(options: PlanOptions, j: int, p: int, recompute: bool | None) -> bool:
    """``recompute`` when given, else the fixed policy's rule; under ``auto`` the kept
    variant, never slower, so that bounds read from it stay bounds."""
    if recompute is not None:
        return recompute
    return False if options.checkpoint == "auto" else recomputes(options.checkpoint, j, p)


def stage_compute(
    costs: UnitCosts,
    cluster: Cluster,
    options: PlanOptions,
    j: int,
    recompute: bool | None = None,
) -> np.ndarray:
    """Q_j: prefix sums of stage j's per-unit compute time (recompute included) on device j,
    recomputing as ``recompute`` says (default: the policy; under ``auto`` keeping)."""
    rc = _recomputes(options, j, cluster.n_stages, recompute)
    return costs.compute_prefix(rc) / cluster.devices[j].speed


def stage_backward(
    costs: UnitCosts,
    cluster: Cluster,
    options: PlanOptions,
    j: int,
    recompute: bool | None = None,
) -> tuple[np.ndarray, float]:
    """(prefix table, constant) of stage j's backward B_j alone on device j (recompute
    included): what the stages after it wait for in the drain."""
    rc = _recomputes(options, j, cluster.n_stages, recompute)
    table = (costs.Pr if rc else costs.Pg) / cluster.devices[j].speed
    _, B, _ = stage_time(costs, cluster, options, 0, 0, j, rc)
    return table, B - float(table[1])


def stage_offsets(
    costs: UnitCosts, cluster: Cluster, options: PlanOptions, recompute: bool | None = None
) -> list[float]:
    """o_j: stage j's time beyond its units' compute and its cut (a one-unit stage's excess)."""
    p = cluster.n_stages
    out = []
    for j in range(p):
        rc = _recomputes(options, j, p, recompute)
        F, B, _ = stage_time(costs, cluster, options, 0, 0, j, rc)
        out.append(max(0.0, F + B - float(stage_compute(costs, cluster, options, j, rc)[1])))
    return out


def _greedy(
    tables: list[np.ndarray], offsets: list[float], n: int, T: float
) -> tuple[int, ...] | None:
    """Stage starts when stage j (cost table ``tables[j]`` plus ``offsets[j]``) takes the most
    units whose compute time is <= T, leaving one unit for every later stage."""
    p = len(tables)
    starts = [0]
    for j in range(p - 1):
        Q = tables[j]
        reach = int(np.searchsorted(Q, Q[starts[-1]] + T - offsets[j], side="right")) - 1
        nxt = min(reach, n - (p - 1 - j))
        if nxt <= starts[-1]:
            return None
        starts.append(nxt)
    Q = tables[p - 1]
    return tuple(starts) if Q[n] - Q[starts[-1]] + offsets[p - 1] <= T else None


class Bounds:
    """Compute-only bounds of one m: the min-max partition, S_lb and the boundary windows.

    ``Qc[j]`` is the prefix table of stage j's compute time on device j (recompute included,
    communication left out), so a stage's compute time is a lower bound of its t_j.  When every
    stage has the same cost function, greedily taking the longest stage that fits a threshold
    is exact for the min-max of such monotone interval costs.  The stages' functions differ
    (device speeds; the last stage may not recompute), and then the greedy can fail at a
    threshold some partition meets: a long early stage can push a unit that is cheap only on a
    later stage onto a middle one.  So ``T_lb`` comes from the greedy on the cheapest function,
    each unit at its lowest cost over the stages and the smallest offset (a relaxation: a lower
    bound of max_j t_j over all partitions), and the greedy on the real functions, bisected,
    only gives a partition to hint.
    """

    def __init__(self, costs: UnitCosts, cluster: Cluster, options: PlanOptions) -> None:
        p = cluster.n_stages
        self.n, self.p, self.m = costs.n, p, costs.m
        self.Qc = [stage_compute(costs, cluster, options, j) for j in range(p)]
        self.off = stage_offsets(costs, cluster, options)
        per_unit = np.array([np.diff(Q) for Q in self.Qc])
        self.s_lb = float(per_unit.min(axis=0).sum()) + sum(self.off)
        """A lower bound of sum_j t_j: every unit runs where it is cheapest, no communication."""
        cheapest = np.concatenate([[0.0], np.cumsum(per_unit.min(axis=0))])
        self.t_lb = self._bisect([cheapest] * p, [min(self.off)] * p)[0]
        hi = self._bisect(self.Qc, self.off)[1]
        starts = self.greedy(hi)
        assert starts is not None
        self.hint = starts

    def _bisect(self, tables: list[np.ndarray], offsets: list[float]) -> tuple[float, float]:
        """(lo, hi): the greedy fails at lo (or lo = 0) and succeeds at hi, hi - lo tiny."""
        hi = max(float(Q[-1]) + o for Q, o in zip(tables, offsets))
        lo = 0.0
        if _greedy(tables, offsets, self.n, 0.0) is not None:
            return 0.0, 0.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if mid in (lo, hi) or hi - lo <= 1e-9 * hi:
                break
            if _greedy(tables, offsets, self.n, mid) is None:
                lo = mid
            else:
                hi = mid
        return lo, hi

    def greedy(self, T: float) -> tuple[int, ...] | None:
        """Stage starts when each stage takes the most units whose compute time is <= T."""
        return _greedy(self.Qc, self.off, self.n, T)

    def window(self, T: float) -> tuple[list[int], list[int]]:
        """Bounds on every b_j for partitions whose stages all compute within T."""
        n, p = self.n, self.p
        T = T * (1 + 1e-9) + 1e-15
        upper, lower = [0] * (p + 1), [n] * (p + 1)
        for j in range(p):
            Q, room = self.Qc[j], T - self.off[j]
            upper[j + 1] = max(
                upper[j], int(np.searchsorted(Q, Q[upper[j]] + room, side="right")) - 1
            )
        for j in range(p - 1, -1, -1):
            Q, room = self.Qc[j], T - self.off[j]
            lower[j] = min(
                lower[j + 1], int(np.searchsorted(Q, Q[lower[j + 1]] - room, side="left"))
            )
        lower[0], upper[p] = 0, n
        return lower, upper

    def lower_bound(self) -> float:
        """S_lb + (m - 1) T_lb, a lower bound of the step time of any partition with this m."""
        return self.s_lb + (self.m - 1) * self.t_lb

    def t_max(self, objective: float) -> float:
        """The largest max_j t_j a partition whose step time is <= ``objective`` can have."""
        return objective if self.m == 1 else (objective - self.s_lb) / (self.m - 1)
