"""Exact dynamic program for contiguous pipeline partitioning with memory limits.

Problem.  Split units 0..n-1 into p contiguous non-empty stages and choose m (micro-batches) to
minimise the GPipe step time of :mod:`planner.costmodel`,

    T(m, P) = S(P) + (m - 1) M(P) + R(P),
    S = sum_j a_j,  a_j = t_j + (m - 1) k c_j,  M = max_j s_j,  s_j = t_j - k c_j,
    R = max(U_0, max_{j>0} h_j),  h_j = U_j - D_j  (tied holders: :mod:`solvers.dp_tables`),

with c_j = F_j + B_j, k the contention (0 when m = 1 or p = 1), U_j stage j's optimizer update
and D_j = sum_{i<j} (B_i + C_i / 2) the drain before it, subject to M_j <= cap_j on every
stage.  The objective mixes a sum and two maxima, so a plain prefix DP is not exact.

The tail.  For a bound theta >= 0 let every stage j > 0 keep h_j <= theta and let stage 0 pay
max(U_0 - theta, 0) in S; adding theta gives S + max(U_0, theta) + (m - 1) M >= T, with
equality at theta = max(0, max_{j>0} h_j).  So the optimum is the best over theta in {0} and the
positive h values a stage can take (few: most stages drain far longer than they update), and
theta stops rising once theta plus a lower bound of S + (m - 1) M reaches the incumbent.
h_j depends on the stage's own units and its index alone (D_j = QB[l] + j o_B + C[l] / 2 for
stages of one speed, plus the earlier cuts' trips, bounded by the j - 1 longest before unit l;
see :mod:`solvers.dp_tables`), so the bound is a per-stage mask.  Updates that overlap slow
each other (``Cluster.update_contention`` > 0), which lifts the true R above max h_j: for
p > 2 the DP then minimises that lower bound and reports a gap (:mod:`solvers.dp_tables`); two
stages are enumerated with the contended R and stay exact.

The bottleneck.  For a fixed m and theta we use the bottleneck-threshold method (as in Alpa's
inter-operator pass): for a threshold M let

    S*(M) = min { S(P) : every stage of P has s_j <= M, h_j <= theta and fits in memory },

computed by a prefix DP over (stage, last unit); then min_P T = min_M S*(M) + (m - 1) M over
the distinct steady-state terms M.  S is a sum of per-stage terms, so the prefix DP stays exact.
S* is a non-increasing step function, so only the left ends of its plateaus matter; they are
found by bisection over the sorted candidate thresholds between

    M_min = the min-max stage term (a min-max prefix DP), and
    M_hi  = (T_best - S*(M_hi0)) / (m - 1),

beyond which no threshold can beat the best plan found (T >= S_lb + (m - 1) M).  With m = 1 the
objective is S + R alone and one DP per theta with no threshold suffices.

Every DP is *banded* (:mod:`solvers.dp_tables`): a stage ending at unit r can start no earlier
than a bound set by the threshold and by memory, so one DP costs O(p n W) for a band of W
starts, and the number of DPs is O(k log n) for k plateaus of S*.

Restrictions: the devices must share one speed (their memories may differ); pinned units and
per-stage unit counts are CP-SAT features (:mod:`solvers.cpsat`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from planner.errors import InfeasiblePlanError, UnsupportedConstraintError
from planner.evaluate import check_request, evaluate
from planner.io import format_bytes
from planner.types import Cluster, Plan, PlanOptions, Profile
from planner.unitcosts import microbatch_choices, unit_costs
from planner.updates import update_cost
from solvers.dp_tables import INF, Instance

__all__ = ["partition_dp", "solve_dp"]


@dataclass(frozen=True, slots=True)
class _Result:
    objective: float
    starts: tuple[int, ...]
    bound: float = -np.inf
    """A lower bound of this m's optimum: the objective itself once the search is complete."""


_TAIL_RUNS = 12
_TAIL_WORK = 4096
"""Most tail bounds theta solved in full per m: max(_TAIL_RUNS, _TAIL_WORK / (n p)), so small
instances always finish; past it the plan keeps a proven gap."""


def _solve(inst: Instance, incumbent: float = INF) -> _Result | None:
    """Exact min over partitions of T(m) for one micro-batch count.

    R = max(U_0, max_{j>0} h_j), h_j = U_j - D_j, is a second bottleneck.  For a tail bound theta
    every stage j > 0 must have h_j <= theta and stage 0 pays max(U_0 - theta, 0) + theta in S;
    that is T(m) exactly at theta = max(0, max_{j>0} h_j) and more elsewhere, so the best over
    theta = 0 and the positive h values is the optimum.  Below the last stage's least h_last no
    partition is admitted.  A theta is skipped when theta plus the least floor over the last
    stage starts it admits (:func:`_floors`) cannot beat the incumbent: a large theta costs
    itself, a small one forces a short last stage and a long bottleneck.  The thetas are tried
    coarse to fine (:func:`_coarse_to_fine`), so that good plans come early and prune the rest.
    Where many survive (hundreds of units with a long update, or a tied parameter's all-reduce
    on both end stages), at most ``limit`` are solved and the result carries the least bound
    of the rest instead of being proven optimal.  Two stages have one cut, which fixes every
    term: they are enumerated instead (:func:`_two_stages`).  Where the tied-gradient tail is
    only bounded from below (``inst.exact`` False), the bound is the least relaxed objective
    seen.  ``incumbent`` (the best step time of the micro-batch counts solved before) prunes
    too.
    """

    def done(best: _Result | None, bound: float = INF) -> _Result | None:
        if best is None:
            return None
        bound = min(bound, best.objective, INF if inst.exact else inst.relaxed_min)
        return _Result(best.objective, best.starts, bound)

    if inst.p == 2 and inst.tail_on:
        return _two_stages(inst)
    thetas = inst.thetas()
    # The last stage must keep h_last <= theta: below its least h nothing is admitted (a tied
    # LM head's all-reduce puts every h_last above 0).
    lowest = float(np.min(inst.h_last[np.isfinite(inst.t_last)], initial=INF))
    bounded = inst.p > 1 and inst.tail_on  # else theta is unused (see Instance.last)
    best = _solve_m(inst, 0.0, None) if lowest <= 0 or not bounded else None
    thetas = thetas[thetas >= lowest]
    if not len(thetas):
        return done(best)
    # Under theta the last stage starts where h_last <= theta, so T >= theta + the least floor
    # over those starts: a small theta forces a short last stage and a long bottleneck.
    floors = np.where(np.isfinite(inst.t_last), _floors(inst), INF)
    # The least floor over the starts with h_last <= theta, for every theta at once: the
    # floors' running minimum in the order of h_last.
    order = np.argsort(inst.h_last, kind="stable")
    least = np.minimum.accumulate(floors[order])
    k = np.searchsorted(inst.h_last[order], thetas, side="right")
    lbs = thetas + np.where(k > 0, least[np.maximum(k - 1, 0)], INF)
    limit = max(_TAIL_RUNS, _TAIL_WORK // (inst.n * inst.p))
    runs, left = 0, INF
    for i in _coarse_to_fine(len(thetas)):  # good plans early, so the floors prune the rest
        theta, lb = float(thetas[i]), float(lbs[i])
        if lb >= min(INF if best is None else best.objective, incumbent):
            continue  # nothing under this theta beats this m's or another m's best
        if runs >= limit and best is not None:
            left = min(left, lb)
            continue
        best = _solve_m(inst, theta, best)
        runs += 1
    return done(best, left)


def _two_stages(inst: Instance) -> _Result | None:
    """p = 2 with a tail: the single cut L decides both stages, so every L where both fit is
    evaluated exactly (at most n - 1 closed forms; no tail bound to search)."""
    V, _ = inst.run_mid(INF, "sum", INF)  # stage 0 over units 0..L-1: finite where it fits
    best: _Result | None = None
    for L in np.flatnonzero(np.isfinite(V + inst.t_last)):
        obj = inst.step_time((0, int(L)))
        if best is None or obj < best.objective:
            best = _Result(obj, (0, int(L)), obj)
    return best


def _floors(inst: Instance) -> np.ndarray:
    """Per last-stage start L, a lower bound of T(m) less R over the partitions whose last
    stage starts at L: S_lb(L) + (m - 1) max(min-max M(L), s_last(L))."""
    if inst.floor_vec is None:
        inst.floor_vec = _floor_vector(inst)
    return inst.floor_vec


def _floor_vector(inst: Instance) -> np.ndarray:
    m, p = inst.m, inst.p
    mm, _ = inst.run_mid(INF, "max", INF)
    s_lb = (inst.Qmid + (p - 1) * inst.op) * (1.0 + inst.ka) + inst.a_last
    if m == 1:
        return np.asarray(s_lb)
    return np.asarray(s_lb + (m - 1) * np.maximum(mm, inst.s_last))


def _floor(inst: Instance) -> float:
    """A lower bound of T(m) less R over all partitions (the least of :func:`_floors`)."""
    return float(np.min(_floors(inst)))


def _coarse_to_fine(k: int) -> list[int]:
    """0..k-1 ordered by halving: 0, then the middle, then the quarters, ...

    >>> _coarse_to_fine(6)
    [0, 4, 2, 1, 3, 5]
    """
    out: list[int] = []
    seen: set[int] = set()
    step = 1 << max(k - 1, 1).bit_length()
    while step >= 1:
        for i in range(0, k, step):
            if i not in seen:
                seen.add(i)
                out.append(i)
        step //= 2
    return out


def _solve_m(inst: Instance, theta: float, best: _Result | None) -> _Result | None:
    """Exact min over partitions of S + (m - 1) M under the tail bound theta (see module doc);
    ``best`` is the incumbent over earlier thetas."""
    m, n, p = inst.m, inst.n, inst.p
    tl, sl = inst.last(theta), inst.s_last

    def consider(V: np.ndarray, choice: np.ndarray, M: float) -> None:
        """Best last-stage start under threshold M; keep it if its true step time is better."""
        nonlocal best
        val = V + tl + (m - 1) * np.maximum(M, sl) if m > 1 else V + tl
        L = int(np.argmin(val))
        if not np.isfinite(val[L]):
            return
        starts = inst.starts(choice, L)
        obj = inst.step_time(starts)
        if not inst.exact:
            inst.relaxed_min = min(inst.relaxed_min, inst.relaxed(starts))
        if best is None or obj < best.objective:
            best = _Result(obj, starts)

    if p == 1 or m == 1:  # no bottleneck term, or a single stage: one DP with no threshold
        V, choice = inst.run_mid(INF, "sum", theta)
        consider(V, choice, 0.0)  # no mid stages when p == 1; the M term is unused when m == 1
        return best
    # 1. A threshold G at which some plan exists; the min-max DP is exact wherever <= G.
    total = float(inst.Qmid[n] + inst.comm.sum() + p * inst.op) * (1.0 + inst.kappa)
    G = max(total / p, 1e-300)
    while True:
        V, choice = inst.run_mid(G, "sum", theta)
        consider(V, choice, G)
        if best is not None and np.isfinite(V + tl).any():
            break
        if not np.isfinite(G):
            return best
        G = G * 2 if G < total else INF
    mm, mm_choice = inst.run_mid(G, "max", theta)
    mm_lb = np.where(mm <= G, mm, G)  # a lower bound on the mid bottleneck for every L
    assert best is not None
    if not inst.comm.any() and not inst.tail_on:
        # Free links, no updates: S = (1 + (m - 1) k) (Qmid[L] + (p - 1) o) + a_last(L) for
        # every partition, so the min-max DP decides.  mm[L] is exact where <= G and a lower
        # bound (G) elsewhere: grow G until the minimiser is exact.
        base = (inst.Qmid + (p - 1) * inst.op) * (1.0 + inst.ka) + tl
        while True:
            val = base + (m - 1) * np.maximum(mm_lb, sl)
            L = int(np.argmin(val))
            if mm[L] <= G or not np.isfinite(val[L]):
                break
            G = max(G * 1.5, float(mm_lb[L]) * 1.5) if G < total else INF
            mm, mm_choice = inst.run_mid(G, "max", theta)
            mm_lb = np.where(mm <= G, mm, G)
        if np.isfinite(val[L]):
            starts = inst.starts(mm_choice, L)
            obj = inst.step_time(starts)
            return _Result(obj, starts) if obj < best.objective else best
        return best
    # 2. Thresholds above M_top cannot win: S >= (1 + (m - 1) k)(Qmid[L] + (p - 1) o) + tl(L)
    # (communication and stage 0's update >= 0).
    s_lb = (inst.Qmid + (p - 1) * inst.op) * (1.0 + inst.ka) + tl
    finite = np.isfinite(s_lb)
    if not finite.any():
        return best
    m_top = (best.objective - float(np.min(s_lb[finite]))) / (m - 1)
    top = G
    if m_top > G:
        top = m_top
        V, choice = inst.run_mid(top, "sum", theta)
        consider(V, choice, top)
    v_lb = V  # S*_mid at the top threshold bounds every lower threshold's from below
    relevant_floor = v_lb + tl + (m - 1) * np.maximum(mm_lb, sl)
    rel = relevant_floor < best.objective
    if not rel.any():
        return best
    # 3. Bisection over candidate thresholds for the left ends of S*'s plateaus.
    cands = list(inst.candidates(float(np.min(mm_lb[rel])), top))
    if not cands or cands[-1] < top:
        cands.append(top)
    cache: dict[int, np.ndarray] = {len(cands) - 1: V}

    def values(i: int) -> np.ndarray:
        if i not in cache:
            Vi, ch = inst.run_mid(float(cands[i]), "sum", theta)
            consider(Vi, ch, float(cands[i]))
            cache[i] = Vi
        return cache[i]

    def search(lo: int, hi: int) -> None:
        """cands[lo] and cands[hi] are evaluated; look between them."""
        if hi - lo <= 1:
            return
        assert best is not None
        # Between the two, S*_mid >= its value at cands[hi] and M >= cands[lo + 1].
        floor = values(hi) + tl + (m - 1) * np.maximum(np.maximum(mm_lb, sl), cands[lo + 1])
        if not (floor < best.objective).any():
            return
        rel = relevant_floor < best.objective
        if np.array_equal(values(lo)[rel], values(hi)[rel]):
            return  # S*_mid is flat on relevant L: nothing between beats the left end
        mid = (lo + hi) // 2
        values(mid)
        search(lo, mid)
        search(mid, hi)

    values(0)
    search(0, len(cands) - 1)
    return best


def partition_dp(
    profile: Profile, cluster: Cluster, options: PlanOptions
) -> tuple[tuple[int, ...], int, float] | None:
    """Optimal (stage starts, m, step time), or ``None`` when no partition fits in memory."""
    found = _partition(profile, cluster, options)
    return None if found is None else found[:3]


def _partition(
    profile: Profile, cluster: Cluster, options: PlanOptions
) -> tuple[tuple[int, ...], int, float, float] | None:
    """(stage starts, m, step time, a lower bound of the optimum) or ``None``."""
    _check_supported(cluster, options)
    check_request(profile, cluster, options)
    caps = np.array([d.memory_bytes for d in cluster.devices], dtype=np.float64)
    best: tuple[tuple[int, ...], int, float] | None = None
    bound = float(np.inf)
    update = update_cost(profile, options.optimizer, cluster)
    insts = [
        (m, Instance(unit_costs(profile, m), cluster, options, caps, update))
        for m in microbatch_choices(profile, options)
    ]
    # Where a tail bound is searched (p > 2 with updates or tied gradients), the most promising
    # m first: its step time then cuts the other m's searches short, or skips them.
    floors = {m: _floor(inst) if inst.p > 2 and inst.tail_on else -INF for m, inst in insts}
    for m, inst in sorted(insts, key=lambda item: (floors[item[0]], item[0])):
        incumbent = INF if best is None else best[2]
        if floors[m] > incumbent:
            bound = min(bound, floors[m])
            continue
        res = _solve(inst, incumbent)
        if res is None:
            continue
        bound = min(bound, res.bound)
        if best is None or (res.objective, m) < (best[2], best[1]):
            best = (res.starts, m, res.objective)
    return None if best is None else (*best, min(bound, best[2]))


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
    found = _partition(profile, cluster, options)
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
    starts, m, objective, bound = found
    proven = bound >= objective * (1 - 1e-12)
    return evaluate(
        profile,
        cluster,
        options,
        starts[1:],
        m,
        solver="dp",
        status="optimal" if proven else "feasible",
        gap=None if proven else (objective - bound) / objective,
        solve_time_s=elapsed,
    )
