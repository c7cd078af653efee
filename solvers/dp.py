"""Exact dynamic program for contiguous pipeline partitioning with memory limits.

Problem.  Split units 0..n-1 into p contiguous non-empty stages and choose m (micro-batches) to
minimise the GPipe step time of :mod:`planner.costmodel`,

    T(m, P) = S(P) + (m - 1) M(P) + R(P),
    S = sum_j a_j,  a_j = t_j + (m - 1) k c_j,  M = max_j s_j,  s_j = t_j - k c_j,
    R = max(U_0, max_{j>0} h_j),  h_j = U_j - D_j  (U_j + A - D_s for tied holders, below),

with c_j = F_j + B_j, k the contention (0 when m = 1 or p = 1), U_j stage j's optimizer update
and D_j = sum_{i<j} B_i + C_{j-1} / 2 the drain before it, subject to M_j <= cap_j on every
stage.  The objective mixes a sum and two maxima, so a plain prefix DP is not exact.

The tail.  For a bound theta >= 0 let every stage j > 0 keep h_j <= theta and let stage 0 pay
max(U_0 - theta, 0) in S; adding theta gives S + max(U_0, theta) + (m - 1) M >= T, with
equality at theta = max(0, max_{j>0} h_j).  So the optimum is the best over theta in {0} and the
positive h values a stage can take (few: most stages drain far longer than they update), and
theta stops rising once theta plus a lower bound of S + (m - 1) M reaches the incumbent.
h_j depends on the stage's own units and its index alone (D_j = QB[l] + j o_B + C[l] / 2 for
stages of one speed), so the bound is a per-stage mask.

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

Every DP is *banded*: s_j = (1 - k) c_j + C_j grows with the stage's length when k < 1, so
under threshold M a stage ending at unit r can start no earlier than lo_M(r) (k >= 1 drops this
band), and the DP looks only at the W = max_r (r - lo_M(r) + 1) last start positions.  Memory bounds W too: parameters, gradients,
optimizer state and activations only grow with a stage, so no stage longer than that monotone
part allows under the largest memory cap can fit.  One DP costs O(p n W) in vectorised numpy;
the number of DPs is O(k log n) for k plateaus, small in practice since S varies only through
communication and the last stage's recomputation.

Tied gradients.  A stage holding a copy of a shared parameter that spans stages waits for its
all-reduce (A seconds), which starts when its first holder s finishes: h_j = U_j + A - D_s.
D_s = 0 when the parameter's owner is unit 0 or stage 0 (j = 1), and D_s = D_j on the owner's
own stage, so with one shared parameter owned by unit 0 (a tied embedding and LM head), or on
two stages, h_j stays per-stage and the DP exact.  Otherwise D_j stands in for the unknown
D_s <= D_j, and several shared parameters count the largest A alone: the DP then minimises a
lower bound of T(m), re-evaluates its plans exactly, and reports the least relaxed value as the
bound (status ``feasible`` with a gap when it falls short).

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
    contention,
    evaluate,
    holds_user,
    in_flight,
    microbatch_choices,
    recomputes,
    step_time,
    tied_syncs,
    unit_costs,
    update_rate,
    update_tail,
)
from planner.errors import InfeasiblePlanError, UnsupportedConstraintError
from planner.io import format_bytes
from planner.types import Cluster, Plan, PlanOptions, Profile

__all__ = ["partition_dp", "solve_dp"]

_INF = np.inf


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


class _Instance:
    """Banded costs and memory of one micro-batch count m.

    Stages 0..p-2 ("mid" stages) share one cost formula; the last stage, which starts at unit L,
    is handled as a vector over L.  ``run_mid`` returns, for every L, the best value of the first
    p - 1 stages over units 0..L-1.
    """

    def __init__(
        self,
        costs: UnitCosts,
        cluster: Cluster,
        options: PlanOptions,
        caps: np.ndarray,
        rate: float = 0.0,
    ):
        self.c = costs
        self.n = n = costs.n
        self.p = cluster.n_stages
        self.m = costs.m
        self.caps = caps
        speed = cluster.devices[0].speed
        x = costs.x
        one_way = cluster.link.one_way_s(x, costs.msgs)
        one_way[n] = 0.0
        self.comm = 2.0 * one_way  # comm[k]: round trip across the cut before unit k
        self.policy = options.checkpoint
        rc_mid = recomputes(options.checkpoint, 0, 2)
        rc_last = recomputes(options.checkpoint, self.p - 1, self.p)
        # Stage compute of units l..r: (Q[r + 1] - Q[l]) + the stage's constant.
        self.Qmid = costs.compute_prefix(rc_mid) / speed
        self.Qlast = costs.compute_prefix(rc_last) / speed
        # A stage's constant: the engine's cost of one forward and one backward, plus one
        # checkpoint call's own cost when it recomputes.
        call = (costs.call_f + costs.call_b) / speed
        o = cluster.engine_overhead_s
        self.op = 2.0 * o + (call if rc_mid else 0.0)
        op_last = 2.0 * o + (call if rc_last else 0.0)
        # The backward alone of mid stages, for the drain D_j = QB[l] + j * ob + comm[l] / 2.
        self.QB = (costs.Pr if rc_mid else costs.Pg) / speed
        self.ob = o + (costs.call_b / speed if rc_mid else 0.0)
        self.kappa = contention(cluster, self.m)
        self.ka = (self.m - 1) * self.kappa  # c_j's weight in S: k per steady-state slot
        self.wk = 2 + OPTIMIZER_STATES[options.optimizer]
        self.u = rate / speed  # update seconds per parameter byte
        # Tied gradients: per shared parameter (first user, last user, sorted users, all-reduce
        # seconds).  A stage holding a user of one that spans stages waits for its all-reduce,
        # and for the first holder, even on a free link.
        self.syncs = [
            (int(users[0]), int(users[-1]), users, cluster.allreduce_s(float(nbytes)))
            for nbytes, users in costs.shared
        ]
        self.cluster = cluster
        # Exact when the all-reduce's first holder is known to drain last-but-none (D = 0):
        # one shared parameter owned by unit 0 or on 2 stages; else a lower bound (see tail).
        self.exact = len(self.syncs) == 0 or (
            len(self.syncs) == 1 and (self.syncs[0][0] == 0 or self.p <= 2)
        )
        self.tail_on = bool(self.u) or bool(self.syncs)
        self.relaxed_min = _INF
        self.floor_vec: np.ndarray | None = None  # _floors' result, computed once
        self.q = [in_flight(options.schedule, j, self.p, self.m) for j in range(self.p)]
        # The last stage as a vector over its first unit L (inf where it does not fit).
        L = np.arange(n + 1)
        j = self.p - 1
        w = costs.Pw[n] - costs.Pw[L] + costs.shared_bytes(L, n - 1)
        a = costs.Pa[n] - costs.Pa[L]
        self.U_last = self.u * w
        # h of the last stage: how long its update outlasts the step's last backward.
        self.h_last = self.tail(j, L, np.full(L.shape, n - 1), self.U_last)
        if rc_last:
            mem = w * self.wk + self.q[j] * x + a
        else:
            mem = w * self.wk + self.q[j] * a
        mem = mem + self.q[j] * int(costs.loss_a)
        ok = (mem <= caps[j]) & (L < n)
        loss = (costs.loss_f + costs.loss_g) / speed
        self.t_last = np.where(ok, self.Qlast[n] - self.Qlast[L] + op_last + loss, _INF)
        # The last stage has no cut (c = t): its term of S, and of the bottleneck.
        # ... plus the engine's fixed cost per step, the same for every partition.
        self.a_last = self.t_last * (1.0 + self.ka) + cluster.step_overhead_s
        self.step_cost = cluster.step_overhead_s
        if self.p == 1:  # a single stage: its update U_0 ends the step
            self.a_last = self.a_last + self.U_last
        self.s_last = self.t_last * (1.0 - self.kappa)
        # Memory bounds a mid stage's length too: its parameters, gradients, optimizer state
        # and activations only grow with it (stash and shared copies only add), so no stage
        # longer than w_mem fits the largest cap.
        mids = range(self.p - 1)
        q_min = min((self.q[j] for j in mids), default=1)
        grow = costs.Pw * self.wk + (costs.Pa if rc_mid else q_min * costs.Pa)
        cap = max((float(caps[j]) for j in mids), default=float(caps[0]))
        r = np.arange(n)
        lo = np.searchsorted(grow, grow[r + 1] - cap - 1e-9 * max(cap, 1.0), side="left")
        self.w_mem = int(max(1, np.max(r - np.minimum(lo, r) + 1)))

    def drain(self, j: int, l: np.ndarray | int) -> np.ndarray:
        """D_j of a stage j > 0 starting at unit l: the backward of the j mid stages before it
        and the gradient's trip across its first cut (0 for j = 0)."""
        l_arr = np.asarray(l)
        if j == 0:
            return np.zeros(l_arr.shape)
        return self.QB[l_arr] + j * self.ob + self.comm[l_arr] / 2

    def tail(self, j: int, l: np.ndarray, r: np.ndarray, upd: np.ndarray) -> np.ndarray:
        """h_j of stage j over units l..r with update ``upd``: U_j - D_j, or for a stage that
        holds a spanning tied parameter, U_j + A - D_s with s its first holder.

        D_s = 0 when the owner (first user) is unit 0 or sits on stage 0 (j = 1); D_s = D_j
        when stage j owns it.  Otherwise D_s <= D_j is unknown here and D_j is used, a lower
        bound (``self.exact`` is then False and the result carries the bound).
        """
        l_arr, r_arr = np.asarray(l), np.asarray(r)
        own = self.drain(j, l_arr)
        h = upd - own
        for first, last, users, seconds in self.syncs:
            copy = holds_user(users, l_arr, r_arr) & (first < l_arr)  # the owner is earlier
            owns = (l_arr <= first) & (first <= r_arr) & (last > r_arr)
            anchored = first == 0 or j <= 1
            d = np.where(copy & anchored, 0.0, own)
            h = np.where(copy | owns, np.maximum(h, upd + seconds - d), h)
        return h

    def relaxed(self, starts: tuple[int, ...]) -> float:
        """The objective the DP minimises for a partition: T(m) with the tail of :meth:`tail`
        (a lower bound of the true T(m) where ``self.exact`` is False)."""
        busy, times, upd = self._stages(starts)
        ends = [*starts[1:], self.n]
        h = [
            float(self.tail(j, np.array(l), np.array(e - 1), np.array(u)))
            for j, (l, e, u) in enumerate(zip(starts[:-1], ends, upd))
        ]
        h.append(float(self.h_last[starts[-1]]))
        return step_time(times, self.m, busy, self.kappa) + max(0.0, *h) + self.step_cost

    def _stages(
        self, starts: tuple[int, ...]
    ) -> tuple[list[float], list[float], list[float]]:
        """(c_j, t_j, U_j) of every stage of a partition (U_j of the mid stages only)."""
        ends = [*starts[1:], self.n]
        c = self.c
        busy = [float(self.Qmid[e] - self.Qmid[l] + self.op) for l, e in zip(starts[:-1], ends)]
        times = [b + float(self.comm[e]) for b, e in zip(busy, ends)]
        upd = [
            self.u * float(c.Pw[e] - c.Pw[l] + c.shared_bytes(l, e - 1))
            for l, e in zip(starts[:-1], ends)
        ]
        busy.append(float(self.t_last[starts[-1]]))
        times.append(busy[-1])
        return busy, times, upd

    def width(self, threshold: float) -> int:
        """Longest mid stage (in units) whose s can be <= threshold and that can fit."""
        if not np.isfinite(threshold) or self.n < 2 or self.kappa >= 1.0:
            # s = (1 - k) c + C does not grow with the stage when k >= 1: no band.
            return min(max(self.n, 1), self.w_mem)
        r = np.arange(self.n - 1)
        room = (threshold - self.comm[r + 1]) / (1.0 - self.kappa)
        need = self.Qmid[r + 1] + self.op - room  # fits iff Q[l] >= need
        lo = np.searchsorted(self.Qmid, need - 1e-12 * max(1.0, abs(threshold)), side="left")
        return int(min(self.n, self.w_mem, int(np.max(r - np.minimum(lo, r) + 1))))

    def band(
        self, W: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[tuple[int, float], np.ndarray]]:
        """(l, a, s, U) of every mid stage l = r - d .. r, d < W, as (n, W) arrays (a: its term
        of S, s: its steady-state slot term, U: its update); memory masks."""
        n, c = self.n, self.c
        r = np.arange(n)[:, None]
        l = r - np.arange(W)[None, :]
        valid = (l >= 0) & (r < n - 1)
        lc = np.where(valid, l, 0)
        busy = self.Qmid[r + 1] - self.Qmid[lc] + self.op
        t = busy + self.comm[np.minimum(r + 1, n)]
        a = np.where(valid, t + self.ka * busy, _INF)
        s = np.where(valid, t - self.kappa * busy, _INF)
        w = c.Pw[r + 1] - c.Pw[lc] + c.shared_bytes(lc, r)
        upd = self.u * w
        w = w * self.wk
        acts = c.Pa[r + 1] - c.Pa[lc]
        rc = recomputes(self.policy, 0, 2)
        masks: dict[tuple[int, float], np.ndarray] = {}
        for j in range(self.p - 1):
            key = (self.q[j], float(self.caps[j]))
            if key not in masks:
                mem = w + self.q[j] * c.x[lc] + acts if rc else w + self.q[j] * acts
                masks[key] = valid & (mem <= self.caps[j])
        return np.where(valid, l, n + 1), a, s, upd, masks

    def run_mid(
        self, threshold: float, mode: str, theta: float = 0.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """V[L] = min-sum (or min-max) over the first p - 1 stages covering 0..L-1, s <= threshold,
        every stage j > 0 with U_j - D_j <= theta.

        Returns V (length n + 1) and the back-pointers ``choice[j, r]`` = length - 1 of stage j
        when it ends at unit r.
        """
        n, p = self.n, self.p
        dp = np.full(n + 2, _INF)  # dp[k]: units 0..k-1 covered; slot n + 1 stays inf
        dp[0] = 0.0 if mode == "sum" else -_INF  # s_j < 0 when k > 1
        choice = np.zeros((max(p - 1, 0), n), dtype=np.int64)
        if p == 1:
            return dp[: n + 1], choice
        lidx, a, s, upd, masks = self.band(self.width(threshold))
        ok = s <= threshold
        # Per memory mask: stage 0's costs (its update beyond theta is paid in S, as it ends
        # the step) and the later stages'.
        first: dict[tuple[int, float], np.ndarray] = {}
        later: dict[tuple[int, float], np.ndarray] = {}
        for key, mask in masks.items():
            later[key] = np.where(mask & ok, a if mode == "sum" else s, _INF)
            first[key] = later[key]
        lc = np.minimum(lidx, n)
        rows = np.arange(n)
        if mode == "sum" and self.tail_on:
            h0 = self.tail(0, lc, rows[:, None], upd)
            for key in masks:
                first[key] = later[key] + np.maximum(h0 - theta, 0.0)
        # h_j <= theta for j > 0, computed as thetas() does (theta is one of them).
        bounded = self.tail_on and np.isfinite(theta)
        for j in range(p - 1):
            key = (self.q[j], float(self.caps[j]))
            cost = first[key] if j == 0 else later[key]
            if j > 0 and bounded:
                cost = np.where(self.tail(j, lc, rows[:, None], upd) <= theta, cost, _INF)
            cand = dp[lidx] + cost if mode == "sum" else np.maximum(dp[lidx], cost)
            choice[j] = np.argmin(cand, axis=1)
            new = np.full(n + 2, _INF)
            new[1 : n + 1] = cand[rows, choice[j]]
            dp = new
        return dp[: n + 1], choice

    def last(self, theta: float) -> np.ndarray:
        """The last stage's term of the objective under theta, over its first unit L: a_last
        plus theta itself (R <= max(U_0, theta)), inf where its update outlasts theta."""
        if self.p == 1 or not self.tail_on:
            return self.a_last
        return np.where(self.h_last <= theta, self.a_last + theta, _INF)

    def thetas(self) -> np.ndarray:
        """Every positive U_j - D_j a stage j > 0 can have, ascending (the tails worth trying)."""
        if self.p == 1 or not self.tail_on:
            return np.zeros(0)
        lidx, _, _, upd, _ = self.band(self.w_mem)
        lc = np.minimum(lidx, self.n)
        rows = np.arange(self.n)[:, None]
        vals = [self.h_last[np.isfinite(self.t_last)]]
        for j in range(1, self.p - 1):
            h = self.tail(j, lc, rows, upd)
            vals.append(h[lidx <= self.n])
        out = np.concatenate(vals)
        return np.unique(out[out > 0])

    def candidates(self, lo: float, hi: float) -> np.ndarray:
        """Sorted distinct mid-stage steady-state terms s in [lo, hi]."""
        _, _, s, _, _ = self.band(self.width(hi))
        vals = s[(s >= lo) & (s <= hi)]
        return np.unique(vals)

    def starts(self, choice: np.ndarray, L: int) -> tuple[int, ...]:
        out = [L]
        for j in range(self.p - 2, -1, -1):
            r = out[-1] - 1
            out.append(r - int(choice[j][r]))
        return tuple(reversed(out))

    def step_time(self, starts: tuple[int, ...]) -> float:
        """The exact T(m) of a partition (as :func:`planner.costmodel.evaluate` computes it)."""
        busy, times, upd = self._stages(starts)
        ends = [*starts[1:], self.n]
        back = [float(self.QB[e] - self.QB[l] + self.ob) for l, e in zip(starts[:-1], ends)]
        back.append(0.0)  # the last stage's backward is no stage's drain
        upd.append(float(self.U_last[starts[-1]]))
        comm = [float(self.comm[e]) for e in ends]
        syncs = tied_syncs(self.c.shared, self.cluster, starts)
        tail = update_tail(upd, back, comm, syncs)
        return step_time(times, self.m, busy, self.kappa) + tail + self.step_cost


def _solve(inst: _Instance, incumbent: float = _INF) -> _Result | None:
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

    def done(best: _Result | None, bound: float = _INF) -> _Result | None:
        if best is None:
            return None
        bound = min(bound, best.objective, _INF if inst.exact else inst.relaxed_min)
        return _Result(best.objective, best.starts, bound)

    if inst.p == 2 and inst.tail_on:
        return _two_stages(inst)
    thetas = inst.thetas()
    # The last stage must keep h_last <= theta: below its least h nothing is admitted (a tied
    # LM head's all-reduce puts every h_last above 0).
    lowest = float(np.min(inst.h_last[np.isfinite(inst.t_last)], initial=_INF))
    bounded = inst.p > 1 and inst.tail_on  # else theta is unused (see _Instance.last)
    best = _solve_m(inst, 0.0, None) if lowest <= 0 or not bounded else None
    thetas = thetas[thetas >= lowest]
    if not len(thetas):
        return done(best)
    # Under theta the last stage starts where h_last <= theta, so T >= theta + the least floor
    # over those starts: a small theta forces a short last stage and a long bottleneck.
    floors = np.where(np.isfinite(inst.t_last), _floors(inst), _INF)
    limit = max(_TAIL_RUNS, _TAIL_WORK // (inst.n * inst.p))
    runs, left = 0, _INF
    for i in _coarse_to_fine(len(thetas)):  # good plans early, so the floors prune the rest
        theta = float(thetas[i])
        lb = theta + float(np.min(floors[inst.h_last <= theta], initial=_INF))
        if lb >= min(_INF if best is None else best.objective, incumbent):
            continue  # nothing under this theta beats this m's or another m's best
        if runs >= limit and best is not None:
            left = min(left, lb)
            continue
        best = _solve_m(inst, theta, best)
        runs += 1
    return done(best, left)


def _two_stages(inst: _Instance) -> _Result | None:
    """p = 2 with a tail: the single cut L decides both stages, so every L where both fit is
    evaluated exactly (at most n - 1 closed forms; no tail bound to search)."""
    V, _ = inst.run_mid(_INF, "sum", _INF)  # stage 0 over units 0..L-1: finite where it fits
    best: _Result | None = None
    for L in np.flatnonzero(np.isfinite(V + inst.t_last)):
        obj = inst.step_time((0, int(L)))
        if best is None or obj < best.objective:
            best = _Result(obj, (0, int(L)), obj)
    return best


def _floors(inst: _Instance) -> np.ndarray:
    """Per last-stage start L, a lower bound of T(m) less R over the partitions whose last
    stage starts at L: S_lb(L) + (m - 1) max(min-max M(L), s_last(L))."""
    if inst.floor_vec is None:
        inst.floor_vec = _floor_vector(inst)
    return inst.floor_vec


def _floor_vector(inst: _Instance) -> np.ndarray:
    m, p = inst.m, inst.p
    mm, _ = inst.run_mid(_INF, "max", _INF)
    s_lb = (inst.Qmid + (p - 1) * inst.op) * (1.0 + inst.ka) + inst.a_last
    if m == 1:
        return np.asarray(s_lb)
    return np.asarray(s_lb + (m - 1) * np.maximum(mm, inst.s_last))


def _floor(inst: _Instance) -> float:
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


def _solve_m(inst: _Instance, theta: float, best: _Result | None) -> _Result | None:
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
        V, choice = inst.run_mid(_INF, "sum", theta)
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
        G = G * 2 if G < total else _INF
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
            G = max(G * 1.5, float(mm_lb[L]) * 1.5) if G < total else _INF
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
    rate = update_rate(profile, options.optimizer)
    insts = [
        (m, _Instance(unit_costs(profile, m), cluster, options, caps, rate))
        for m in microbatch_choices(profile, options)
    ]
    # Where a tail bound is searched (p > 2 with updates or tied gradients), the most promising
    # m first: its step time then cuts the other m's searches short, or skips them.
    floors = {m: _floor(inst) if inst.p > 2 and inst.tail_on else -_INF for m, inst in insts}
    for m, inst in sorted(insts, key=lambda item: (floors[item[0]], item[0])):
        incumbent = _INF if best is None else best[2]
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
