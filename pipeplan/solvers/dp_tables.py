"""The dynamic program's tables for one micro-batch count: banded stage costs, memory, tails.

:class:`Instance` holds, for one m, everything :mod:`pipeplan.solvers.dp` searches over: the prefix
sums that give a stage's compute, backward and communication in O(1), the last stage as a
vector over its first unit, the memory masks of every mid stage, and the tail r_j of a stage
(its update's excess over its drain, or its wait for a tied all-reduce).  :meth:`run_mid` is
one prefix DP over the first p - 1 stages; the searches that call it (thresholds, tail nodes,
the choice of m) live in :mod:`pipeplan.solvers.dp_threshold` and :mod:`pipeplan.solvers.dp`.

Every DP is *banded*: s_j = (1 - k) c_j + C_j grows with the stage's length when k < 1, so
under threshold M a stage ending at unit r can start no earlier than lo_M(r) (k >= 1 drops this
band), and the DP looks only at the W = max_r (r - lo_M(r) + 1) last start positions.  Memory
bounds W too: parameters, gradients, optimizer state and activations only grow with a stage, so
no stage longer than that monotone part allows under the largest memory cap can fit.  One DP
costs O(p n W) in vectorised numpy.  The band's tables are built once per instance, at the
widest W asked for so far, and sliced for narrower ones.

The tail.  R = max_j E_j (:mod:`pipeplan.planner.costmodel`), E_j = ready_j + U_j without update
contention.  With r_0 = E_0 (U_0, or A + U_0 when stage 0 holds a tied parameter's copy) and
r_j for j >= 1 stage j's E_j as :meth:`Instance.tail` bounds it from below, the *relaxed* tail
(:meth:`Instance.relaxed`) is

    (1 - k_u) max_j r_j + k_u sum_j max(r_j, 0),    k_u = min(kappa_u, 1),

a lower bound of the true R, equal to it where every r_j is exact and the updates do not
contend.  The k_u part: without tied parameters every update but stage 0's starts before stage
0's last backward ends (time 0), with at least max(r_j, 0) of work left then, and stage 0's
starts at 0 with r_0; from then on they share the devices (rate 1 / (1 + kappa_u (a - 1)) for
a under way), which ends the last at exactly max + kappa_u (sum - max) of the work left
(:func:`pipeplan.planner.updates.shared_ends`), no less than the bound, and more work only delays it.
With tied parameters holders start later, and k_u = 0.

The DP charges the relaxed tail through a *tail node* (:class:`TailNode`: a charged stage k, a
floor f and a cap c):

    every stage j pays  k_u max(r_j, 0)  in its term of S, stage k also (1 - k_u) max(r_k, f),
    every stage j != k must have r_j <= c,

the last stage's terms and cap as a vector over its first unit, a mid stage's as a table over
the band.  A node's objective is at most the relaxed objective of every partition whose largest
tail over the uncharged stages lies in [f, c], so :mod:`pipeplan.solvers.dp` covers all of them with
nodes and splits them at the level of what they find.

Tied gradients.  A stage holding a copy of a shared parameter that spans stages waits for its
all-reduce (A seconds), which starts when its first holder s finishes: r_j = U_j + A - D_s.
D_s = 0 when the parameter's owner is unit 0 or stage 0 (j = 1), and D_s = D_j on the owner's
own stage, so with one shared parameter owned by unit 0 (a tied embedding and LM head), or on
two stages, r_j is exact.  Otherwise D_j stands in for the unknown D_s <= D_j, and several
shared parameters count the largest A alone: a lower bound.  The same holds for the drain D_j
of a stage j >= 2 on a link that costs time: it includes the gradient's trips across the j - 1
cuts before the stage's own, which :meth:`Instance.drain` can only bound from above.  Where the
bound is not tight at the plan found, the result says so with a gap (``Instance.exact`` tells
whether it can ever fall short).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pipeplan.planner.costmodel import (
    contention,
    in_flight,
    memory_parts,
    recomputes,
    stage_recomputes,
    step_time,
    tied_syncs,
)
from pipeplan.planner.types import PlanOptions
from pipeplan.planner.unitcosts import UnitCosts, holds_user
from pipeplan.planner.updates import update_tail
from pipeplan.solvers.request import ResolvedRequest

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


_StageTimes = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
"""(c_j, t_j, U_j) of a partition's stages."""


@dataclass(frozen=True, slots=True)
class TailNode:
    """Partitions whose tail over the stages other than ``charged`` is at most ``cap``, charged
    as if it were at least ``floor``: the charged stage k pays (1 - k_u) max(r_k, floor) in S,
    every other stage must keep r_j <= cap (see the module doc)."""

    floor: float = -INF
    cap: float = INF
    charged: int = 0


#: A band's per-key tables stacked (:meth:`Instance._stacked`): stage -> index, masks, s, a.
_Stacked = tuple[list[int], np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, slots=True)
class Band:
    """Every mid stage l = r - d .. r, d < W, as (n, W) arrays over (r, d)."""

    lidx: np.ndarray
    """Its first unit l, or n + 1 where the cell is no stage (d > r, or r = n - 1)."""
    a: dict[tuple[int, float, bool], np.ndarray]
    """Per key (as ``masks``): its term of S, t + (m - 1) k c (inf outside the band).  The
    keys share one array unless the policy is ``auto``, where a stage's key decides whether it
    can keep its activations."""
    s: dict[tuple[int, float, bool], np.ndarray]
    """Per key: its steady-state slot term t - k c (inf outside the band)."""
    upd: np.ndarray
    """U: its optimizer update."""
    r1: np.ndarray
    """Its tail as stage 1, the largest it has as any stage j >= 1 (-inf outside the band)."""
    masks: dict[tuple[int, float, bool], np.ndarray]
    """Per (micro-batches in flight, memory cap, a stage after the first): where it fits."""

    def narrow(self, W: int) -> Band:
        """The first W columns."""
        return Band(
            self.lidx[:, :W],
            {k: v[:, :W] for k, v in self.a.items()},
            {k: v[:, :W] for k, v in self.s.items()},
            self.upd[:, :W],
            self.r1[:, :W],
            {k: v[:, :W] for k, v in self.masks.items()},
        )

    @property
    def width(self) -> int:
        return int(self.lidx.shape[1])


class Instance:
    """Banded costs and memory of one micro-batch count m.

    Stages 0..p-2 ("mid" stages) share one cost formula; the last stage, which starts at unit L,
    is handled as a vector over L.  ``run_mid`` returns, for every L, the best value of the first
    p - 1 stages over units 0..L-1.
    """

    def __init__(self, request: ResolvedRequest, costs: UnitCosts):
        cluster, options, caps = request.cluster, request.options, request.caps
        self.c = costs
        self.n = n = costs.n
        self.p = cluster.n_stages
        self.m = costs.m
        self.caps = caps
        self.state = request.state  # training state per byte
        # allowed[b]: a stage may start at unit b (PlanOptions.allowed_cuts); a stage's cells
        # are valid only where the next one may start after them.
        self.allowed = request.allowed
        speed = cluster.devices[0].speed
        x = costs.x
        one_way = cluster.link.one_way_s(x, costs.msgs)
        one_way[n] = 0.0
        self.comm = 2.0 * one_way  # comm[k]: round trip across the cut before unit k
        # trips[l, k]: the k longest trips across cuts before unit l, summed.  The drain D_j
        # counts the trips across the j - 1 cuts before stage j's first one, which a prefix
        # DP cannot see, so drain() bounds them by trips[l, j - 1] (see tail()).
        self.trips = longest_sums(self.comm[: n + 1], max(self.p - 2, 0))
        # Under ``auto`` each stage keeps its activations where that fits its device and
        # recomputes elsewhere (pipeplan.planner.costmodel.stage_recomputes): both variants'
        # tables are built, and a stage's cells take the one its memory allows.  Where every
        # stage of every partition can keep, auto is ``never``, and these are never's tables.
        self.all_keep = options.checkpoint == "auto" and self._keeps_everywhere(
            costs, options, caps
        )
        if self.all_keep:
            options = options.model_copy(update={"checkpoint": "never"})
        self.policy = options.checkpoint
        self.options = options
        self.auto = options.checkpoint == "auto"
        rc_mid = True if self.auto else recomputes(options.checkpoint, 0, 2)
        rc_last = recomputes(options.checkpoint, self.p - 1, self.p) if not self.auto else True
        o = cluster.engine_overhead_s
        # Stage compute of units l..r: (Q[r + 1] - Q[l]) + the stage's constant, the engine's
        # cost of one forward and one backward plus one checkpoint call's own cost when it
        # recomputes; the backward alone (QB, ob) gives the drain D_j = QB[l] + j ob + ....
        self.variants = {rc: self._variant(costs, speed, o, rc) for rc in (False, True)}
        self.Qmid, self.op, self.QB, self.ob = self.variants[rc_mid]
        self.Qmid_hi, self.op_hi = self.Qmid, self.op
        if self.auto:
            # Lower bounds read the kept variant (never slower), the thresholds' ceiling the
            # recomputing one, and the drain the recomputing one too: an upper bound of D_j
            # whatever the earlier stages chose, so r_j = U_j - D_j stays a lower bound.
            self.Qmid, self.op = self.variants[False][0], self.variants[False][1]
        self.kappa = contention(cluster, self.m)
        self.ka = (self.m - 1) * self.kappa  # c_j's weight in S: k per steady-state slot
        self.wk = self.state.total
        self.update = request.update  # U(w) at speed 1 (pipeplan.planner.updates)
        # a partition's stages, each a function of (j, l, r) alone, looked up once: a cut's
        # move (_balanced, the tails) changes two stages and re-reads the rest
        self._recomputes: dict[tuple[int, int, int], bool] = {}
        self._stage_update: dict[tuple[int, int], float] = {}
        self._stage_memo: dict[tuple[int, ...], _StageTimes] = {}
        self._tail_memo: dict[tuple[int, ...], np.ndarray] = {}
        self.speed = speed
        # Tied gradients: per shared parameter (first user, last user, sorted users, all-reduce
        # seconds).  A stage holding a user of one that spans stages waits for its all-reduce,
        # and for the first holder, even on a free link.
        self.syncs = [
            (int(users[0]), int(users[-1]), users, cluster.allreduce_s(float(nbytes)))
            for nbytes, users in costs.shared
        ]
        self.cluster = cluster
        self.tail_on = bool(self.update) or bool(self.syncs)
        # kappa_u in the relaxed tail: only without tied parameters (see the module doc); two
        # stages are enumerated with the exact tail instead (dp._two_stages).
        self.kappa_u = (
            min(cluster.update_contention, 1.0)
            if self.p > 2 and self.tail_on and not self.syncs
            else 0.0
        )
        # Whether r_j is exact for every stage and the relaxed tail the true one: one shared
        # parameter owned by unit 0 or on 2 stages, no update contention, and for p > 2 no
        # trips before a stage's own cut (a free link).
        self.exact = len(self.syncs) == 0 or (
            len(self.syncs) == 1 and (self.syncs[0][0] == 0 or self.p <= 2)
        )
        if cluster.update_contention > 0 and self.p > 2 and self.tail_on:
            self.exact = False
        if self.p > 2 and self.tail_on and float(np.max(self.trips[:, -1])) > 0:
            self.exact = False
        if self.auto and self.p > 2 and self.tail_on:
            self.exact = False  # the drain is an upper bound
        self.q = [in_flight(options.schedule, j, self.p, self.m) for j in range(self.p)]
        self.keys = [(self.q[j], float(caps[j]), j > 0) for j in range(self.p)]
        # The last stage as a vector over its first unit L (inf where it does not fit).
        L = np.arange(n + 1)
        j = self.p - 1
        w = costs.Pw[n] - costs.Pw[L] + costs.shared_bytes(L, n - 1)
        self.U_last = self.upd(w)
        # r of the last stage: how long its update outlasts the step's last backward.
        self.h_last = self.tail(j, L, np.full(L.shape, n - 1), self.U_last)
        loss = (costs.loss_f + costs.loss_g) / speed
        self.rc_last = np.full(L.shape, rc_last)
        t_last = np.full(L.shape, INF)
        for rc in (True, False) if self.auto else (rc_last,):  # kept last: it wins where it fits
            Q, op, _, _ = self.variants[rc]
            full = np.full(L.shape, n - 1)
            mem = sum(
                memory_parts(costs, options, j, self.p, L, full, w, rc, state=self.state).values()
            )
            ok = (mem <= caps[j]) & (L < n) & self.allowed[L]
            t_last = np.where(ok, Q[n] - Q[L] + op + loss, t_last)
            self.rc_last = np.where(ok, rc, self.rc_last)
        self.t_last = t_last
        # The last stage has no cut (c = t): its term of S, and of the bottleneck.
        # ... plus the engine's fixed cost per step, the same for every partition.
        self.a_last = self.t_last * (1.0 + self.ka) + cluster.step_overhead_s
        self.step_cost = cluster.step_overhead_s
        if self.p == 1:  # a single stage: its update U_0 ends the step
            self.a_last = self.a_last + self.U_last
        self.s_last = self.t_last * (1.0 - self.kappa)
        # Stage 0 over units 0..r, by r: its tail r_0 (its update, after a tied all-reduce
        # when it holds a spanning shared parameter).
        r = np.arange(n)
        zero = np.zeros(n, dtype=np.int64)
        self.r0 = self.tail(0, zero, r, self.upd(costs.Pw[r + 1] + costs.shared_bytes(zero, r)))
        # Memory bounds a mid stage's length too: its parameters, gradients, optimizer state
        # and activations only grow with it (stash and shared copies only add), so no stage
        # longer than w_mem fits the largest cap.
        mids = range(self.p - 1)
        q_min = min((self.q[j] for j in mids), default=1)
        grow = costs.Pw * (self.wk - 1) + (costs.Pa if rc_mid else q_min * costs.Pa)  # auto: rc
        cap = max((float(caps[j]) for j in mids), default=float(caps[0]))
        lo = np.searchsorted(grow, grow[r + 1] - cap - 1e-9 * max(cap, 1.0), side="left")
        self.w_mem = int(max(1, np.max(r - np.minimum(lo, r) + 1)))
        self.r0_min = float(np.min(self.r0))
        self._band: Band | None = None
        self._blocked: dict[float, tuple[int, list[tuple[np.ndarray, np.ndarray]]]] = {}
        self._mid_tails: dict[int, np.ndarray] = {}
        self._stacks: dict[int, _Stacked] = {}

    @staticmethod
    def _variant(
        costs: UnitCosts, speed: float, o: float, rc: bool
    ) -> tuple[np.ndarray, float, np.ndarray, float]:
        """(Q, op, QB, ob) of a stage that does (``rc``) or does not recompute: its compute's
        prefix table and constant, its backward's prefix table and constant."""
        call = (costs.call_f + costs.call_b) / speed
        return (
            costs.compute_prefix(rc) / speed,
            2.0 * o + (call if rc else 0.0),
            (costs.Pr if rc else costs.Pg) / speed,
            o + (costs.call_b / speed if rc else 0.0),
        )

    def _keeps_everywhere(self, costs: UnitCosts, options: PlanOptions, caps: np.ndarray) -> bool:
        """Whether every stage of every partition fits keeping its activations: M_j with the
        whole model's activations, parameters and largest parameter and the largest cut
        bounds any stage's (every part of M_j grows with them) and fits each cap."""
        n, p = costs.n, self.p
        widest = dataclasses.replace(costs, x=np.full_like(costs.x, float(np.max(costs.x))))
        w = float(costs.Pw[n]) + sum(float(nb) for nb, _ in costs.shared)
        return all(
            float(
                sum(
                    memory_parts(
                        widest, options, j, p, 0, n - 1, w, False, state=self.state
                    ).values()
                )
            )
            <= caps[j]
            for j in range(p)
        )

    def recomputing(self, j: int, l: int, r: int) -> bool:
        """Whether mid stage j over units l..r recomputes (the policy's rule, or under
        ``auto`` whether keeping does not fit)."""
        key = (j, l, r)
        got = self._recomputes.get(key)
        if got is None:
            got = self._recomputes[key] = stage_recomputes(
                self.c, self.cluster, self.options, l, r, j
            )
        return got

    def _update_of(self, l: int, e: int) -> float:
        """U of a stage over units l..e-1 (its parameters and its tied copies)."""
        got = self._stage_update.get((l, e))
        if got is None:
            c = self.c
            got = float(self.upd(c.Pw[e] - c.Pw[l] + c.shared_bytes(l, e - 1)))
            self._stage_update[(l, e)] = got
        return got

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
        bound otherwise (``self.exact`` is then False): r_j = U_j - D_j is bounded from below,
        and the DP's objective with it from below too."""
        l_arr = np.asarray(l)
        if j == 0:
            return np.zeros(l_arr.shape)
        cut = self.comm[l_arr] / 2 + self.trips[l_arr, j - 1] / 2
        return self.QB[l_arr] + j * self.ob + cut

    def tail(self, j: int, l: np.ndarray, r: np.ndarray, upd: np.ndarray) -> np.ndarray:
        """r_j of stage j over units l..r with update ``upd``: U_j - D_j, or for a stage that
        holds a spanning tied parameter, U_j + A - D_s with s its first holder.

        D_s = 0 when the owner (first user) is unit 0 or sits on stage 0 (j = 1); D_s = D_j
        when stage j owns it.  Otherwise D_s <= D_j is unknown here and D_j is used, a lower
        bound (``self.exact`` is then False and the result carries the bound).  r_j does not
        grow with j (D_j does not shrink), so r_1 bounds every later stage's.
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

    def share(self, r: np.ndarray | float) -> np.ndarray:
        """kappa_u max(r, 0): what a stage's tail adds to the relaxed tail beyond the longest."""
        return np.asarray(self.kappa_u * np.maximum(r, 0.0))

    def charge(self, r: np.ndarray | float, floor: float) -> np.ndarray:
        """The charged stage's part of the longest tail, (1 - kappa_u) max(r, floor)."""
        return np.asarray((1.0 - self.kappa_u) * np.maximum(r, floor))

    def stage0(self, node: TailNode, mode: str = "sum") -> np.ndarray:
        """What stage 0 adds under ``node``, by its last unit r: in the sum, its share and its
        charge when charged; inf where it breaks the cap when not."""
        if not self.tail_on or self.p == 1:
            return np.zeros(self.n)
        out = np.zeros(self.n)
        if mode == "sum":
            out = out + self.share(self.r0)
            if node.charged == 0:
                out = out + self.charge(self.r0, node.floor)
        if node.charged != 0:
            out = np.where(self.r0 <= node.cap, out, INF)
        return out

    def last(self, node: TailNode) -> np.ndarray:
        """The last stage's term of S over its first unit L under ``node``: its share and,
        when charged, its charge added; inf where it does not fit or breaks the cap."""
        if self.p == 1 or not self.tail_on:
            return self.a_last
        out = self.a_last + self.share(self.h_last)
        if node.charged == self.p - 1:
            return out + self.charge(self.h_last, node.floor)
        if not np.isfinite(node.cap):
            return out
        return np.where(self.h_last <= node.cap, out, INF)

    def least_charge(self, node: TailNode) -> float:
        """A lower bound of what the stages' tails add to S, outside the last stage's term."""
        if not self.tail_on or self.p == 1:
            return 0.0
        if node.charged == 0:
            return float(np.min(self.stage0(node)))
        if node.charged == self.p - 1:
            return 0.0
        return float(self.charge(0.0, node.floor))

    def _mid_variants(
        self, starts: tuple[int, ...]
    ) -> list[tuple[np.ndarray, float, np.ndarray, float]]:
        """Each mid stage's (Q, op, QB, ob) as it recomputes or not."""
        ends = [*starts[1:], self.n]
        return [
            self.variants[self.recomputing(j, l, e - 1)]
            for j, (l, e) in enumerate(zip(starts[:-1], ends))
        ]

    def _stages(self, starts: tuple[int, ...]) -> _StageTimes:
        """(c_j, t_j, U_j) of every stage of a partition (U_j of the mid stages only), made
        once per partition (a search asks for most of them several times)."""
        got = self._stage_memo.get(starts)
        if got is not None:
            return got
        ends = [*starts[1:], self.n]
        busy = [
            float(Q[e] - Q[l] + op)
            for (Q, op, _, _), l, e in zip(self._mid_variants(starts), starts[:-1], ends)
        ]
        times = [b + float(self.comm[e]) for b, e in zip(busy, ends)]
        upd = [self._update_of(l, e) for l, e in zip(starts[:-1], ends)]
        busy.append(float(self.t_last[starts[-1]]))
        times.append(busy[-1])
        got = self._stage_memo[starts] = (tuple(busy), tuple(times), tuple(upd))
        return got

    def tails(self, starts: tuple[int, ...]) -> np.ndarray:
        """r_j of every stage of a partition, as the tables compute them (once per partition;
        the array is shared: do not write to it)."""
        if self.p == 1:
            return np.array([self.r0[self.n - 1]])
        got = self._tail_memo.get(starts)
        if got is not None:
            return got
        ends = [*starts[1:], self.n]
        _, _, upd = self._stages(starts)
        out = [float(self.r0[ends[0] - 1])]
        for j in range(1, self.p - 1):
            l, e = starts[j], ends[j]
            out.append(float(self.tail(j, np.array(l), np.array(e - 1), np.array(upd[j]))))
        out.append(float(self.h_last[starts[-1]]))
        got = self._tail_memo[starts] = np.array(out)
        got.flags.writeable = False
        return got

    def _base(self, starts: tuple[int, ...]) -> float:
        """T(m) without the tail."""
        busy, times, _ = self._stages(starts)
        base = step_time(times, self.m, busy, self.kappa) + self.step_cost
        return base + float(self.U_last[0]) if self.p == 1 else base

    def relaxed(self, starts: tuple[int, ...]) -> float:
        """The objective the DP bounds for a partition: T(m) with the relaxed tail
        (1 - kappa_u) max_j r_j + kappa_u sum_j max(r_j, 0) (a lower bound of the true T(m)
        where ``self.exact`` is False)."""
        base = self._base(starts)
        if self.p == 1 or not self.tail_on:
            return base
        r = self.tails(starts)
        return base + float(self.charge(float(np.max(r)), -INF) + np.sum(self.share(r)))

    def objective(self, starts: tuple[int, ...], node: TailNode) -> float:
        """A partition's objective under ``node`` (inf where it breaks the node's cap)."""
        base = self._base(starts)
        if self.p == 1 or not self.tail_on:
            return base
        r = self.tails(starts)
        k = node.charged
        if float(np.max(np.delete(r, k))) > node.cap:
            return INF
        return base + float(self.charge(float(r[k]), node.floor) + np.sum(self.share(r)))

    def closes(self, starts: tuple[int, ...], node: TailNode) -> tuple[bool, float]:
        """(whether the partition's relaxed objective equals its objective under ``node``,
        rho: the largest tail of the stages other than the charged one)."""
        r = self.tails(starts)
        k = node.charged
        rho = float(np.max(np.delete(r, k)))
        return rho <= max(float(r[k]), node.floor), rho

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

    def band(self, W: int) -> Band:
        """The band of width W (built at the widest width asked for, sliced for less)."""
        W = max(1, min(W, self.n))
        if self._band is None or self._band.width < W:
            have = 0 if self._band is None else self._band.width
            self._band = self._build_band(min(self.n, max(W, have + have // 2)))
            self._blocked.clear()
            self._mid_tails.clear()
            self._stacks.clear()
        if self._band.width == W:
            return self._band
        return self._band.narrow(W)

    def _build_band(self, W: int) -> Band:
        n, c = self.n, self.c
        r = np.arange(n)[:, None]
        l = r - np.arange(W)[None, :]
        valid = (l >= 0) & (r < n - 1) & self.allowed[np.minimum(r + 1, n)]
        lc = np.where(valid, l, 0)
        cut = self.comm[np.minimum(r + 1, n)]

        def terms(Q: np.ndarray, op: float) -> tuple[np.ndarray, np.ndarray]:
            busy = Q[r + 1] - Q[lc] + op
            t = busy + cut
            return np.where(valid, t + self.ka * busy, INF), np.where(
                valid, t - self.kappa * busy, INF
            )

        a, s = terms(self.Qmid, self.op)  # the policy's (auto: the kept variant)
        if self.auto:
            a_rc, s_rc = terms(self.Qmid_hi, self.op_hi)
        w = c.Pw[r + 1] - c.Pw[lc] + c.shared_bytes(lc, r)
        upd = self.upd(w)
        r1 = np.where(valid, self.tail(1, lc, np.broadcast_to(r, lc.shape), upd), -INF)
        masks: dict[tuple[int, float, bool], np.ndarray] = {}
        a_by: dict[tuple[int, float, bool], np.ndarray] = {}
        s_by: dict[tuple[int, float, bool], np.ndarray] = {}
        rr = np.broadcast_to(r, lc.shape)
        for j in range(self.p - 1):
            key = self.keys[j]
            if key in masks:
                continue
            if not self.auto:
                mem = sum(
                    memory_parts(c, self.options, j, self.p, lc, rr, w, state=self.state).values()
                )
                masks[key], a_by[key], s_by[key] = valid & (mem <= self.caps[j]), a, s
                continue
            fits = {
                rc: valid
                & (sum(memory_parts(c, self.options, j, self.p, lc, rr, w, rc, state=self.state).values())
                   <= self.caps[j])
                for rc in (False, True)
            }  # fmt: skip
            masks[key] = fits[False] | fits[True]
            a_by[key] = np.where(fits[False], a, a_rc)
            s_by[key] = np.where(fits[False], s, s_rc)
        return Band(np.where(valid, l, n + 1), a_by, s_by, upd, r1, masks)

    def blocked(self, cap: float, W: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per mid stage j, the band cells (rows, columns < W) whose tail as stage j exceeds
        ``cap``: few, since r_j <= r_1 and r_1 <= cap almost everywhere."""
        band = self.band(W)
        full = self._band
        assert full is not None
        width = full.width
        if cap not in self._blocked or self._blocked[cap][0] != width:
            rows, cols = np.nonzero(full.r1 > cap)
            per_j = [(rows[:0], cols[:0])]
            if len(rows):
                l, u = full.lidx[rows, cols], full.upd[rows, cols]
                for j in range(1, self.p - 1):
                    over = self.tail(j, l, rows, u) > cap
                    per_j.append((rows[over], cols[over]))
            else:
                per_j *= self.p - 1
            self._blocked[cap] = (width, per_j)
        per_j = self._blocked[cap][1]
        if band.width == width:
            return per_j
        W = band.width
        return [(rr[cc < W], cc[cc < W]) for rr, cc in per_j]

    def mid_tail(self, k: int, W: int) -> np.ndarray:
        """r_k of every band cell as mid stage k (0 outside the band)."""
        band = self.band(W)
        full = self._band
        assert full is not None
        if k not in self._mid_tails or self._mid_tails[k].shape != full.r1.shape:
            lc = np.minimum(full.lidx, self.n - 1)
            rows = np.broadcast_to(np.arange(self.n)[:, None], lc.shape)
            self._mid_tails[k] = np.where(
                full.lidx <= self.n, self.tail(k, lc, rows, full.upd), 0.0
            )
        return self._mid_tails[k][:, : band.width]

    def run_mid(
        self, threshold: float, mode: str, node: TailNode | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """V[L] = min-sum (or min-max) over the first p - 1 stages covering 0..L-1, s <= threshold,
        under ``node``: its charged stage pays its charge (in the sum only), every other stage
        meets its cap.

        Returns V (length n + 1) and the back-pointers ``choice[j, r]`` = length - 1 of stage j
        when it ends at unit r.
        """
        n, p = self.n, self.p
        node = node or TailNode()
        dp = np.full(n + 2, INF)  # dp[k]: units 0..k-1 covered; slot n + 1 stays inf
        dp[0] = 0.0 if mode == "sum" else -INF  # s_j < 0 when k > 1
        choice = np.zeros((max(p - 1, 0), n), dtype=np.int64)
        if p == 1:
            return dp[: n + 1], choice
        W = self.width(threshold)
        band = self.band(W)
        idx, fits, slots, terms = self._stacked(band)
        term = terms if mode == "sum" else slots
        cost = np.where(fits & (slots <= threshold), term, INF)  # (distinct keys, n, W)
        tail = self.tail_on and p > 2
        capped = tail and np.isfinite(node.cap)
        blocked = self.blocked(node.cap, W) if capped else []
        rows = np.arange(n)
        for j in range(p - 1):
            c = cost[idx[j]]
            if j == 0:  # only stage 0's cells (l = 0) are reachable: one column per row
                d = np.minimum(rows, band.width - 1)
                first = np.where(d == rows, c[rows, d], INF)
                if tail:
                    first = first + self.stage0(node, mode)
                choice[0] = rows
                dp[0], dp[1 : n + 1], dp[n + 1] = INF, first, INF
                continue
            cand = dp[band.lidx] + c if mode == "sum" else np.maximum(dp[band.lidx], c)
            if tail and mode == "sum" and self.kappa_u:
                cand = cand + self.share(self.mid_tail(j, W))
            if tail and j == node.charged:
                if mode == "sum":
                    cand = cand + self.charge(self.mid_tail(j, W), node.floor)
            elif capped:
                rr, cc = blocked[j]
                cand[rr, cc] = INF
            choice[j] = np.argmin(cand, axis=1)
            dp[1 : n + 1] = cand[rows, choice[j]]  # read through band.lidx above: a copy
        return dp[: n + 1], choice

    def _stacked(self, band: Band) -> _Stacked:
        """The band's per-key tables stacked over the distinct keys of stages 0 .. p - 2 (built
        once per band width): each stage's index into them, then its masks, s and a."""
        hit = self._stacks.get(band.width)
        if hit is None:
            keys = self.keys[: self.p - 1]
            distinct = list(dict.fromkeys(keys))
            at = {key: i for i, key in enumerate(distinct)}
            hit = (
                [at[key] for key in keys],
                np.stack([band.masks[key] for key in distinct]),
                np.stack([band.s[key] for key in distinct]),
                np.stack([band.a[key] for key in distinct]),
            )
            self._stacks[band.width] = hit
        return hit

    def candidates(self, lo: float, hi: float) -> np.ndarray:
        """Sorted distinct mid-stage steady-state terms s in [lo, hi]."""
        s = np.concatenate([v.ravel() for v in self.band(self.width(hi)).s.values()])
        return np.unique(s[(s >= lo) & (s <= hi)])

    def starts(self, choice: np.ndarray, L: int) -> tuple[int, ...]:
        out = [L]
        for j in range(self.p - 2, -1, -1):
            r = out[-1] - 1
            out.append(r - int(choice[j][r]))
        return tuple(reversed(out))

    def step_time(self, starts: tuple[int, ...]) -> float:
        """The exact T(m) of a partition (as :func:`pipeplan.planner.evaluate.evaluate` computes it)."""
        busy, times, mid_upd = self._stages(starts)
        ends = [*starts[1:], self.n]
        back = [
            float(QB[e] - QB[l] + ob)
            for (_, _, QB, ob), l, e in zip(self._mid_variants(starts), starts[:-1], ends)
        ]
        back.append(0.0)  # the last stage's backward is no stage's drain
        upd = [*mid_upd, float(self.U_last[starts[-1]])]
        comm = [float(self.comm[e]) for e in ends]
        syncs = tied_syncs(self.c.shared, self.cluster, starts)
        tail = update_tail(upd, back, comm, syncs, self.cluster.update_contention)
        return step_time(times, self.m, busy, self.kappa) + tail + self.step_cost
