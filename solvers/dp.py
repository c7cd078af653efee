"""Exact dynamic program for contiguous pipeline partitioning with memory limits.

Problem.  Split units 0..n-1 into p contiguous non-empty stages and choose m (micro-batches) to
minimise the GPipe step time of :mod:`planner.costmodel`,

    T(m, P) = S(P) + (m - 1) M(P),   S = sum_j t_j,  M = max_j t_j,

subject to M_j <= cap_j on every stage.  The objective mixes a sum and a maximum, so a plain
prefix DP is not exact.  For a fixed m we use the bottleneck-threshold method (as in Alpa's
inter-operator pass): for a threshold M let

    S*(M) = min { S(P) : every stage of P has t_j <= M and fits in memory },

computed by a prefix DP over (stage, last unit); then min_P T = min_M S*(M) + (m - 1) M over
the distinct stage times M.  S* is a non-increasing step function, so only the left ends of its
plateaus matter; they are found by bisection over the sorted candidate thresholds between

    M_min = the min-max stage time (a min-max prefix DP), and
    M_hi  = (T_best - S*(M_hi0)) / (m - 1),

beyond which no threshold can beat the best plan found (T >= S_lb + (m - 1) M).  With m = 1 the
objective is S alone and one DP with no threshold suffices.

Every DP is *banded*: stage costs are monotone in the stage's length, so under threshold M a
stage ending at unit r can start no earlier than lo_M(r), and the DP looks only at the
W = max_r (r - lo_M(r) + 1) last start positions.  One DP costs O(p n W) in vectorised numpy;
the number of DPs is O(k log n) for k plateaus, small in practice since S varies only through
communication and the last stage's recomputation.

Restrictions: the devices must share one speed (their memories may differ); pinned units and
per-stage unit counts are CP-SAT features (:mod:`solvers.cpsat`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from planner.costmodel import (
    OPTIMIZER_STATES,
    UnitCosts,
    check_request,
    evaluate,
    in_flight,
    microbatch_choices,
    recomputes,
    unit_costs,
)
from planner.errors import InfeasiblePlanError, UnsupportedConstraintError
from planner.io import format_bytes
from planner.types import Cluster, Plan, PlanOptions, Profile

__all__ = ["solve_dp", "partition_dp"]

_INF = np.inf


@dataclass(frozen=True, slots=True)
class _Result:
    objective: float
    starts: tuple[int, ...]


class _Instance:
    """Banded stage costs and memory for one micro-batch count m."""

    def __init__(self, costs: UnitCosts, cluster: Cluster, options: PlanOptions, caps: np.ndarray):
        self.c = costs
        self.n = costs.n
        self.p = cluster.n_stages
        self.m = costs.m
        self.caps = caps
        speed = cluster.devices[0].speed
        link = cluster.link
        bw = _INF if link.bandwidth_Bps is None else link.bandwidth_Bps
        x = costs.x
        one_way = np.where(x > 0, costs.msgs * (link.latency_s + link.overhead_s) + x / bw, 0.0)
        one_way[self.n] = 0.0
        self.comm = 2.0 * one_way  # comm[k]: round trip across the cut before unit k
        self.rc_mid = recomputes(options.checkpoint, 0, 2)  # any non-last stage
        self.rc_last = recomputes(options.checkpoint, self.p - 1, self.p)
        # Q[k] = prefix of the stage-time numerator, so time(l..r) = (Q[r+1] - Q[l]) / s + comm.
        self.Qmid = ((1 + self.rc_mid) * costs.Pf + costs.Pg) / speed
        self.Qlast = ((1 + self.rc_last) * costs.Pf + costs.Pg) / speed
        k = OPTIMIZER_STATES[options.optimizer]
        self.wk = 2 + k
        self.q = np.array([in_flight(options.schedule, j, self.p, self.m) for j in range(self.p)])
        self.policy = options.checkpoint

    # ---- band geometry --------------------------------------------------------------------

    def width(self, threshold: float) -> int:
        """Largest stage length (in units) whose time can be <= threshold."""
        if not np.isfinite(threshold):
            return self.n
        r = np.arange(self.n)
        w = 1
        for Q, comm in ((self.Qmid, self.comm[1:]), (self.Qlast, np.zeros(self.n))):
            need = Q[r + 1] + comm - threshold  # need Q[l] >= need
            lo = np.searchsorted(Q, need - 1e-12 * max(1.0, abs(threshold)), side="left")
            w = max(w, int(np.max(r - np.minimum(lo, r) + 1)))
        return min(w, self.n)

    def band(self, W: int) -> dict[str, np.ndarray]:
        """Cost and memory of every stage (l = r - d, r) for d < W, as (n, W) arrays."""
        n, c = self.n, self.c
        r = np.arange(n)[:, None]
        l = r - np.arange(W)[None, :]
        valid = l >= 0
        lc = np.where(valid, l, 0)
        t_mid = self.Qmid[r + 1] - self.Qmid[lc] + self.comm[r + 1]
        t_last = self.Qlast[r + 1] - self.Qlast[lc]
        w = c.Pw[r + 1] - c.Pw[lc]
        a = c.Pa[r + 1] - c.Pa[lc]
        return {
            "l": np.where(valid, l, -1),
            "valid": valid,
            "t_mid": np.where(valid, t_mid, _INF),
            "t_last": np.where(valid, t_last, _INF),
            "w": w,
            "a": a,
            "x": c.x[lc],
        }

    def mem_ok(self, band: dict[str, np.ndarray], j: int) -> np.ndarray:
        rc = recomputes(self.policy, j, self.p)
        q = self.q[j]
        if rc:
            mem = band["w"] * self.wk + q * band["x"] + band["a"]
        else:
            mem = band["w"] * self.wk + q * band["a"]
        return band["valid"] & (mem <= self.caps[j])

    # ---- the DPs --------------------------------------------------------------------------

    def run(self, threshold: float, mode: str) -> _Result | None:
        """Min-sum (``mode='sum'``) or min-max (``'max'``) DP over stages with t <= threshold."""
        n, p = self.n, self.p
        W = self.width(threshold)
        band = self.band(W)
        lidx = np.where(band["l"] >= 0, band["l"], n + 1)  # n + 1 indexes an inf slot
        dp = np.full(n + 2, _INF)
        dp[0] = 0.0
        choice = np.zeros((p, n), dtype=np.int64)
        for j in range(p - 1):
            cost = np.where(self.mem_ok(band, j) & (band["t_mid"] <= threshold), band["t_mid"], _INF)
            cand = dp[lidx] + cost if mode == "sum" else np.maximum(dp[lidx], cost)
            choice[j] = np.argmin(cand, axis=1)
            new = np.full(n + 2, _INF)
            new[1 : n + 1] = cand[np.arange(n), choice[j]]
            dp = new
        # The last stage ends at unit n - 1.
        last_ok = self.mem_ok(band, p - 1)[n - 1] & (band["t_last"][n - 1] <= threshold)
        cost = np.where(last_ok, band["t_last"][n - 1], _INF)
        prev = dp[lidx[n - 1]]
        cand = prev + cost if mode == "sum" else np.maximum(prev, cost)
        d = int(np.argmin(cand))
        if not np.isfinite(cand[d]):
            return None
        starts = [n - 1 - d]
        for j in range(p - 2, -1, -1):
            r = starts[-1] - 1
            starts.append(r - int(choice[j][r]))
        starts.reverse()
        return _Result(float(cand[d]), tuple(starts))

    def times(self, starts: tuple[int, ...]) -> list[float]:
        ends = [*starts[1:], self.n]
        out = []
        for j, (l, e) in enumerate(zip(starts, ends)):
            if j < self.p - 1:
                out.append(float(self.Qmid[e] - self.Qmid[l] + self.comm[e]))
            else:
                out.append(float(self.Qlast[e] - self.Qlast[l]))
        return out


def _solve_m(inst: _Instance) -> _Result | None:
    """Exact min over partitions of S + (m - 1) M for one micro-batch count."""
    m = inst.m
    if m == 1:
        return inst.run(_INF, "sum")
    # 1. Bottleneck: the min-max DP on a band wide enough for its own answer.
    guess = max(float(inst.Qmid[-1]) / inst.p, 1e-300)
    mm = None
    while True:
        mm = inst.run(guess, "max")
        if mm is not None or not np.isfinite(guess):
            break
        guess = guess * 2 if guess < float(inst.Qmid[-1] + inst.comm.sum()) else _INF
    if mm is None:
        return None
    m_min = mm.objective
    first = inst.run(m_min, "sum")
    assert first is not None  # the min-max partition is feasible at its own threshold
    best = _Result(first.objective + (m - 1) * max(inst.times(first.starts)), first.starts)

    def consider(res: _Result) -> None:
        nonlocal best
        obj = res.objective + (m - 1) * max(inst.times(res.starts))
        if obj < best.objective:
            best = _Result(obj, res.starts)

    # 2. No plan with M > M_hi0 can win, since S >= S_lb0 (all compute, no communication).
    s_lb0 = min(float(inst.Qmid[-1]), float(inst.Qlast[-1]))
    m_hi0 = (best.objective - s_lb0) / (m - 1)
    if m_hi0 <= m_min:
        return best
    top = inst.run(m_hi0, "sum")
    assert top is not None
    consider(top)
    s_lb = top.objective
    m_hi = (best.objective - s_lb) / (m - 1)
    # 3. Candidate thresholds: every stage time in (M_min, M_hi].
    W = inst.width(m_hi)
    band = inst.band(W)
    vals = np.concatenate([band["t_mid"].ravel(), band["t_last"][inst.n - 1]])
    cands = np.unique(vals[(vals > m_min) & (vals <= m_hi)])
    cache: dict[int, float] = {}

    def s_at(i: int) -> float:
        if i not in cache:
            res = inst.run(float(cands[i]), "sum")
            assert res is not None
            consider(res)
            cache[i] = res.objective
        return cache[i]

    def search(lo: int, hi: int, s_lo: float, s_hi: float) -> None:
        """Thresholds cands[lo..hi]; s_lo = S* just below cands[lo], s_hi = S*(cands[hi])."""
        if lo > hi or s_lo == s_hi:
            return  # S* is flat on the range: nothing below improves the left end
        if s_lb + (m - 1) * float(cands[lo]) >= best.objective:
            return
        if lo == hi:
            s_at(lo)
            return
        mid = (lo + hi) // 2
        s_mid = s_at(mid)
        search(lo, mid, s_lo, s_mid)
        search(mid + 1, hi, s_mid, s_hi)

    if len(cands):
        s_last = s_at(len(cands) - 1)
        search(0, len(cands) - 1, first.objective, s_last)
    return best


def partition_dp(
    profile: Profile, cluster: Cluster, options: PlanOptions
) -> tuple[tuple[int, ...], int, float] | None:
    """Optimal (stage starts, m, step time), or ``None`` when no partition fits in memory."""
    _check_supported(cluster, options)
    check_request(profile, cluster, options)
    caps = np.array([d.memory_bytes for d in cluster.devices], dtype=np.float64)
    best: tuple[tuple[int, ...], int, float] | None = None
    for m in microbatch_choices(profile, options):
        res = _solve_m(_Instance(unit_costs(profile, m), cluster, options, caps))
        if res is not None and (best is None or res.objective < best[2]):
            best = (res.starts, m, res.objective)
    return best


def _check_supported(cluster: Cluster, options: PlanOptions) -> None:
    if not cluster.uniform_speed:
        speeds = sorted({d.speed for d in cluster.devices})
        raise UnsupportedConstraintError(
            f"the DP needs devices of one speed (got {speeds}); use --solver cpsat"
        )
    if options.pinned:
        raise UnsupportedConstraintError("the DP cannot pin units to stages; use --solver cpsat")
    if options.min_units > 1 or options.max_units is not None:
        raise UnsupportedConstraintError(
            "the DP cannot bound units per stage (--min-units/--max-units); use --solver cpsat"
        )


def solve_dp(profile: Profile, cluster: Cluster, options: PlanOptions | None = None) -> Plan:
    """The step-time-optimal feasible plan.

    Raises :class:`InfeasiblePlanError` (with the smallest per-device memory that makes the
    best unconstrained partition fit) when no partition fits.

    >>> from planner.synthetic import synthetic_profile
    >>> prof = synthetic_profile(8, batch_size=8, microbatch_sizes=[1, 2, 4, 8])
    >>> plan = solve_dp(prof, Cluster.homogeneous(2, 2**40))
    >>> (plan.n_stages, plan.status, plan.feasible)
    (2, 'optimal', True)
    """
    options = options or PlanOptions()
    t0 = time.perf_counter()
    found = partition_dp(profile, cluster, options)
    elapsed = time.perf_counter() - t0
    if found is None:
        unlimited = cluster.model_copy(
            update={
                "devices": tuple(
                    d.model_copy(update={"memory_bytes": 2**62}) for d in cluster.devices
                )
            }
        )
        free = partition_dp(profile, unlimited, options)
        assert free is not None
        starts, m, _ = free
        plan = evaluate(profile, unlimited, options, starts[1:], m, solver="dp")
        need = max(s.memory.total for s in plan.stages)
        have = min(d.memory_bytes for d in cluster.devices)
        raise InfeasiblePlanError(
            f"no partition of {profile.n_units} units into {cluster.n_stages} stages fits in "
            f"{format_bytes(have)} per device; the best partition needs {format_bytes(need)} "
            f"(--memory {need}), or add stages, checkpoint more, or use fewer micro-batches",
            min_memory_bytes=need,
        )
    starts, m, _ = found
    return evaluate(
        profile, cluster, options, starts[1:], m, solver="dp", status="optimal", solve_time_s=elapsed
    )
