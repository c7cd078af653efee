"""The dynamic program's tables for one micro-batch count: banded stage costs, memory, tails.

:class:`Instance` holds, for one m, everything :mod:`solvers.dp` searches over: the prefix
sums that give a stage's compute, backward and communication in O(1), the last stage as a
vector over its first unit, the memory masks of every mid stage, and the tail h_j of a
stage (its update's excess over its drain, or its wait for a tied all-reduce).  The
search itself (thresholds, tail bounds, the choice of m) lives in :mod:`solvers.dp`.

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
bound (status ``feasible`` with a gap when it falls short).  The same holds when updates that
overlap slow each other (``Cluster.update_contention`` > 0, see :mod:`planner.costmodel`):
max_j h_j ignores the sharing, a lower bound of the tail, exact again only for p = 2, whose
cuts are enumerated with the contended tail.  And the same holds for the drain D_j of a stage
j >= 2 on a link that costs time: it includes the gradient's trips across the j - 1 cuts before
the stage's own, which :meth:`Instance.drain` can only bound.
"""

from __future__ import annotations

import numpy as np

from planner.costmodel import (
    contention,
    in_flight,
    memory_parts,
    recomputes,
    step_time,
    tied_syncs,
)
from planner.types import OPTIMIZER_STATES, Cluster, PlanOptions
from planner.unitcosts import UnitCosts, holds_user
from planner.updates import UpdateCost, update_tail

__all__: list[str] = []

INF = np.inf


def longest_sums(comm: np.ndarray, k_max: int) -> np.ndarray:
    """S[l, k] = the sum of the k largest of comm[1..l-1], for l = 0..len(comm)-1 and
    k = 0..k_max (all of them where fewer than k exist).

    Built by one sweep over l that keeps the k_max largest values seen in descending order:
    O(n k_max) time and memory.

    >>> longest_sums(np.array([0.0, 3.0, 1.0, 2.0]), 2).tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 3.0, 3.0], [0.0, 3.0, 4.0]]
    """
    n = len(comm)
    out = np.zeros((n, k_max + 1))
    best = np.zeros(k_max)  # the k_max largest so far, descending (0 pads: trips are >= 0)
    for l in range(2, n):
        value = float(comm[l - 1])
        if k_max and value > best[-1]:
            at = int(np.searchsorted(-best, -value, side="right"))
            best[at + 1 :] = best[at:-1].copy()
            best[at] = value
        out[l, 1:] = np.cumsum(best)
    return out


class Instance:
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
        update: UpdateCost | None = None,
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
        # trips[l, k]: the k longest trips across cuts before unit l, summed.  The drain D_j
        # counts the trips across the j - 1 cuts before stage j's first one, which a prefix
        # DP cannot see, so drain() bounds them by trips[l, j - 1] (see tail()).
        self.trips = longest_sums(self.comm[: n + 1], max(self.p - 2, 0))
        self.policy = options.checkpoint
        self.options = options
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
        self.update = update or UpdateCost()  # U(w) at speed 1 (planner.updates)
        self.speed = speed
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
        self.tail_on = bool(self.update) or bool(self.syncs)
        # Updates that overlap slow each other (kappa_u): max_j h_j is then a lower bound of
        # the contended tail.  p = 2 is enumerated with the exact tail (dp._two_stages).
        if cluster.update_contention > 0 and self.p > 2 and self.tail_on:
            self.exact = False
        # The earlier cuts' trips in D_j are bounded, not known, once p > 2 (see drain()).
        if self.p > 2 and self.tail_on and float(np.max(self.trips[:, -1])) > 0:
            self.exact = False
        self.relaxed_min = INF
        self.floor_vec: np.ndarray | None = None  # _floors' result, computed once
        self.q = [in_flight(options.schedule, j, self.p, self.m) for j in range(self.p)]
        # The last stage as a vector over its first unit L (inf where it does not fit).
        L = np.arange(n + 1)
        j = self.p - 1
        w = costs.Pw[n] - costs.Pw[L] + costs.shared_bytes(L, n - 1)
        self.U_last = self.upd(w)
        # h of the last stage: how long its update outlasts the step's last backward.
        self.h_last = self.tail(j, L, np.full(L.shape, n - 1), self.U_last)
        mem = sum(memory_parts(costs, options, j, self.p, L, np.full(L.shape, n - 1), w).values())
        ok = (mem <= caps[j]) & (L < n)
        loss = (costs.loss_f + costs.loss_g) / speed
        self.t_last = np.where(ok, self.Qlast[n] - self.Qlast[L] + op_last + loss, INF)
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
        grow = costs.Pw * (self.wk - 1) + (costs.Pa if rc_mid else q_min * costs.Pa)
        cap = max((float(caps[j]) for j in mids), default=float(caps[0]))
        r = np.arange(n)
        lo = np.searchsorted(grow, grow[r + 1] - cap - 1e-9 * max(cap, 1.0), side="left")
        self.w_mem = int(max(1, np.max(r - np.minimum(lo, r) + 1)))

    def upd(self, nbytes: np.ndarray | float) -> np.ndarray:
        """U of a stage holding ``nbytes`` of parameters on this instance's devices."""
        return self.update(nbytes) / self.speed

    def drain(self, j: int, l: np.ndarray | int) -> np.ndarray:
        """D_j of a stage j > 0 starting at unit l: the backward of the j mid stages before it
        and the gradient's trips across the j cuts before it (0 for j = 0).

        The trip across its own first cut is comm[l] / 2; the j - 1 earlier cuts are distinct
        cuts before unit l, so their trips sum to at most the j - 1 longest of those, halved
        (``trips[l, j - 1] / 2``).  That makes D_j exact for j <= 1, and for j >= 2 where the
        longest trips lie on the plan's cuts (one trip length on every cut, say), and an upper
        bound otherwise (``self.exact`` is then False): h_j = U_j - D_j is bounded from below,
        and the DP's objective with it from below too."""
        l_arr = np.asarray(l)
        if j == 0:
            return np.zeros(l_arr.shape)
        cut = self.comm[l_arr] / 2 + self.trips[l_arr, j - 1] / 2
        return self.QB[l_arr] + j * self.ob + cut

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

    def _stages(self, starts: tuple[int, ...]) -> tuple[list[float], list[float], list[float]]:
        """(c_j, t_j, U_j) of every stage of a partition (U_j of the mid stages only)."""
        ends = [*starts[1:], self.n]
        c = self.c
        busy = [float(self.Qmid[e] - self.Qmid[l] + self.op) for l, e in zip(starts[:-1], ends)]
        times = [b + float(self.comm[e]) for b, e in zip(busy, ends)]
        upd = [
            float(self.upd(c.Pw[e] - c.Pw[l] + c.shared_bytes(l, e - 1)))
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
    ) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[tuple[int, float, bool], np.ndarray]
    ]:
        """(l, a, s, U) of every mid stage l = r - d .. r, d < W, as (n, W) arrays (a: its term
        of S, s: its steady-state slot term, U: its update); memory masks."""
        n, c = self.n, self.c
        r = np.arange(n)[:, None]
        l = r - np.arange(W)[None, :]
        valid = (l >= 0) & (r < n - 1)
        lc = np.where(valid, l, 0)
        busy = self.Qmid[r + 1] - self.Qmid[lc] + self.op
        t = busy + self.comm[np.minimum(r + 1, n)]
        a = np.where(valid, t + self.ka * busy, INF)
        s = np.where(valid, t - self.kappa * busy, INF)
        w = c.Pw[r + 1] - c.Pw[lc] + c.shared_bytes(lc, r)
        upd = self.upd(w)
        masks: dict[tuple[int, float, bool], np.ndarray] = {}
        for j in range(self.p - 1):
            key = (self.q[j], float(self.caps[j]), j > 0)
            if key not in masks:
                rr = np.broadcast_to(r, lc.shape)
                mem = sum(memory_parts(c, self.options, j, self.p, lc, rr, w).values())
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
        dp = np.full(n + 2, INF)  # dp[k]: units 0..k-1 covered; slot n + 1 stays inf
        dp[0] = 0.0 if mode == "sum" else -INF  # s_j < 0 when k > 1
        choice = np.zeros((max(p - 1, 0), n), dtype=np.int64)
        if p == 1:
            return dp[: n + 1], choice
        lidx, a, s, upd, masks = self.band(self.width(threshold))
        ok = s <= threshold
        # Per memory mask: stage 0's costs (its update beyond theta is paid in S, as it ends
        # the step) and the later stages'.
        first: dict[tuple[int, float, bool], np.ndarray] = {}
        later: dict[tuple[int, float, bool], np.ndarray] = {}
        for key, mask in masks.items():
            later[key] = np.where(mask & ok, a if mode == "sum" else s, INF)
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
            key = (self.q[j], float(self.caps[j]), j > 0)
            cost = first[key] if j == 0 else later[key]
            if j > 0 and bounded:
                cost = np.where(self.tail(j, lc, rows[:, None], upd) <= theta, cost, INF)
            cand = dp[lidx] + cost if mode == "sum" else np.maximum(dp[lidx], cost)
            choice[j] = np.argmin(cand, axis=1)
            new = np.full(n + 2, INF)
            new[1 : n + 1] = cand[rows, choice[j]]
            dp = new
        return dp[: n + 1], choice

    def last(self, theta: float) -> np.ndarray:
        """The last stage's term of the objective under theta, over its first unit L: a_last
        plus theta itself (R <= max(U_0, theta)), inf where its update outlasts theta."""
        if self.p == 1 or not self.tail_on:
            return self.a_last
        return np.where(self.h_last <= theta, self.a_last + theta, INF)

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
        """The exact T(m) of a partition (as :func:`planner.evaluate.evaluate` computes it)."""
        busy, times, upd = self._stages(starts)
        ends = [*starts[1:], self.n]
        back = [float(self.QB[e] - self.QB[l] + self.ob) for l, e in zip(starts[:-1], ends)]
        back.append(0.0)  # the last stage's backward is no stage's drain
        upd.append(float(self.U_last[starts[-1]]))
        comm = [float(self.comm[e]) for e in ends]
        syncs = tied_syncs(self.c.shared, self.cluster, starts)
        tail = update_tail(upd, back, comm, syncs, self.cluster.update_contention)
        return step_time(times, self.m, busy, self.kappa) + tail + self.step_cost
