"""The bottleneck-threshold search: the exact minimum of one tail node's objective for one m.

A tail node (:class:`pipeplan.solvers.dp_tables.TailNode`) fixes how the updates' tail is charged, so
its objective is a sum over stages plus the steady-state bottleneck,

    S(P) + (m - 1) M(P),   S = sum_j a_j (+ stage 0's tail charge),   M = max_j s_j,

subject to memory and the node's cap on every stage's tail.  For a threshold M let

    S*(M) = min { S(P) : every stage of P has s_j <= M, fits in memory and meets the cap },

a prefix DP over (stage, last unit) (:meth:`pipeplan.solvers.dp_tables.Instance.run_mid`); then the
minimum is min_M S*(M) + (m - 1) M over the distinct steady-state terms M (the
bottleneck-threshold method, as in Alpa's inter-operator pass).  S* is a non-increasing step
function, so only the left ends of its plateaus matter; they are found by bisection over the
sorted candidate thresholds between

    M_min = the min-max stage term (a min-max prefix DP), and
    M_hi  = (T_best - S_lb) / (m - 1),

beyond which no threshold can beat the best plan found (T >= S_lb + (m - 1) M), and a stretch
of thresholds is skipped once the last-stage starts L it could improve are none.  With m = 1
the objective is S alone and one DP with no threshold suffices.  The number of DPs is
O(k log n) for k plateaus of S*.

Every plan met on the way is offered to the :class:`Incumbent` (the best exact step time over
all m and nodes), whose objective bounds the search: a node that cannot beat it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.solvers.dp_tables import INF, Instance, TailNode

__all__ = ["Found", "Incumbent", "Start", "floor", "prepare", "search"]


@dataclass(slots=True)
class Incumbent:
    """The best plan found so far, over every m: its exact step time, micro-batch count and
    stage starts (ties go to the smaller m)."""

    objective: float = INF
    m: int = 0
    starts: tuple[int, ...] = ()

    def offer(self, inst: Instance, starts: tuple[int, ...]) -> None:
        """Keep the partition if its exact step time beats the incumbent's."""
        T = inst.step_time(starts)
        if (T, inst.m) < (self.objective, self.m):
            self.objective, self.m, self.starts = T, inst.m, starts


@dataclass(frozen=True, slots=True)
class Found:
    """A node's minimum: its objective under the node and a partition that attains it."""

    objective: float
    starts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Start:
    """What every node of one m starts from: a threshold G under which some partition exists
    (memory and the tail's caps aside), and per last-stage start L a lower bound of the mid
    stages' bottleneck (their min-max, exact where <= G)."""

    G: float
    mm_lb: np.ndarray


def _total(inst: Instance) -> float:
    """Every stage's slot term together, an upper bound of any threshold worth trying."""
    return float(inst.Qmid_hi[inst.n] + inst.comm.sum() + inst.p * inst.op_hi) * (1.0 + inst.kappa)


def prepare(inst: Instance) -> Start:
    """Find G by doubling from the mean stage, then the min-max DP under it."""
    n, p = inst.n, inst.p
    if p == 1 or inst.m == 1:
        return Start(INF, np.zeros(n + 1))
    total = _total(inst)
    G = max(total / p, 1e-300)
    while True:
        mm, _ = inst.run_mid(G, "max")
        if np.isfinite(mm + inst.a_last).any() or not np.isfinite(G):
            break
        G = G * 2 if G < total else INF
    return Start(G, np.where(mm <= G, mm, G))


def floor(inst: Instance, start: Start) -> float:
    """A lower bound of T(m) over every partition: per L, the compute every partition whose last
    stage starts at L pays, the tail the last stage and the shortest stage 0 force, and the
    bottleneck's bound; the least over L."""
    p, m = inst.p, inst.m
    if p == 1:
        return float(inst.a_last[0] + (m - 1) * inst.s_last[0] if m > 1 else inst.a_last[0])
    s_lb = (inst.Qmid + (p - 1) * inst.op) * (1.0 + inst.ka) + inst.a_last
    if inst.tail_on:
        s_lb = s_lb + np.maximum(float(np.min(inst.r0)), inst.h_last)
    if m > 1:
        s_lb = s_lb + (m - 1) * np.maximum(start.mm_lb, inst.s_last)
    return float(np.min(s_lb))


def search(inst: Instance, node: TailNode, start: Start, inc: Incumbent) -> Found | None:
    """The node's exact minimum over all partitions, or ``None`` when it cannot beat the
    incumbent (which every plan met may lower)."""
    m, p = inst.m, inst.p
    tl, sl = inst.last(node), inst.s_last
    best: Found | None = None

    def limit() -> float:
        return min(inc.objective, INF if best is None else best.objective)

    def consider(V: np.ndarray, choice: np.ndarray, M: float) -> None:
        """Best last-stage start under threshold M: offer it, keep it if the node's best."""
        nonlocal best
        val = V + tl + (m - 1) * np.maximum(M, sl) if m > 1 else V + tl
        L = int(np.argmin(val))
        if not np.isfinite(val[L]):
            return
        starts = inst.starts(choice, L)
        inc.offer(inst, starts)
        obj = inst.objective(starts, node)
        if best is None or obj < best.objective:
            best = Found(obj, starts)

    def result() -> Found | None:
        return best if best is not None and best.objective < inc.objective else None

    if p == 1 or m == 1:  # no bottleneck term, or a single stage: one DP with no threshold
        V, choice = inst.run_mid(INF, "sum", node)
        consider(V, choice, 0.0)  # no mid stages when p == 1; the M term is unused when m == 1
        return result()
    # 1. A threshold G at which some plan meets the node.
    total = _total(inst)
    G = start.G
    while True:
        V, choice = inst.run_mid(G, "sum", node)
        consider(V, choice, G)
        if np.isfinite(V + tl).any():
            break
        if not np.isfinite(G):
            return result()
        G = G * 2 if G < total else INF
    mm_lb = start.mm_lb
    if G != start.G:
        mm, _ = inst.run_mid(G, "max", node)
        mm_lb = np.where(mm <= G, mm, G)
    assert best is not None
    if not inst.comm.any() and not inst.tail_on and not inst.auto:
        return _free_link(inst, G, best, inc)  # S is the same for every partition
    # 2. Thresholds above M_top cannot win: S >= (1 + (m - 1) k)(Qmid[L] + (p - 1) o) + tl(L)
    # + the charged stage's least charge (communication >= 0).
    s_lb = (inst.Qmid + (p - 1) * inst.op) * (1.0 + inst.ka) + tl + inst.least_charge(node)
    finite = np.isfinite(s_lb)
    if not finite.any():
        return result()
    m_top = (limit() - float(np.min(s_lb[finite]))) / (m - 1)
    top = G
    if m_top > G:
        top = m_top
        V, choice = inst.run_mid(top, "sum", node)
        consider(V, choice, top)
    v_lb = V  # S*_mid at the top threshold bounds every lower threshold's from below
    relevant_floor = v_lb + tl + (m - 1) * np.maximum(mm_lb, sl)
    rel = relevant_floor < limit()
    if not rel.any():
        return result()
    # 3. Bisection over candidate thresholds for the left ends of S*'s plateaus.
    cands = list(inst.candidates(float(np.min(mm_lb[rel])), top))
    if not cands or cands[-1] < top:
        cands.append(top)
    cache: dict[int, np.ndarray] = {len(cands) - 1: V}

    def values(i: int) -> np.ndarray:
        if i not in cache:
            Vi, ch = inst.run_mid(float(cands[i]), "sum", node)
            consider(Vi, ch, float(cands[i]))
            cache[i] = Vi
        return cache[i]

    def bisect(lo: int, hi: int) -> None:
        """cands[lo] and cands[hi] are evaluated; look between them."""
        if hi - lo <= 1:
            return
        # Between the two, S*_mid >= its value at cands[hi] and M >= cands[lo + 1].
        bottom = values(hi) + tl + (m - 1) * np.maximum(np.maximum(mm_lb, sl), cands[lo + 1])
        if not (bottom < limit()).any():
            return
        rel = relevant_floor < limit()
        if np.array_equal(values(lo)[rel], values(hi)[rel]):
            return  # S*_mid is flat on relevant L: nothing between beats the left end
        mid = (lo + hi) // 2
        values(mid)
        bisect(lo, mid)
        bisect(mid, hi)

    values(0)
    bisect(0, len(cands) - 1)
    return result()


def _free_link(inst: Instance, G: float, best: Found, inc: Incumbent) -> Found | None:
    """Free links, no updates: S = (1 + (m - 1) k) (Qmid[L] + (p - 1) o) + a_last(L) for every
    partition, so the min-max DP decides.  mm[L] is exact where <= G and a lower bound (G)
    elsewhere: grow G until the minimiser is exact."""
    m, p = inst.m, inst.p
    sl, total = inst.s_last, _total(inst)
    base = (inst.Qmid + (p - 1) * inst.op) * (1.0 + inst.ka) + inst.a_last
    mm, mm_choice = inst.run_mid(G, "max")
    while True:
        mm_lb = np.where(mm <= G, mm, G)
        val = base + (m - 1) * np.maximum(mm_lb, sl)
        L = int(np.argmin(val))
        if mm[L] <= G or not np.isfinite(val[L]):
            break
        G = max(G * 1.5, float(mm_lb[L]) * 1.5) if G < total else INF
        mm, mm_choice = inst.run_mid(G, "max")
    if np.isfinite(val[L]):
        starts = inst.starts(mm_choice, L)
        inc.offer(inst, starts)
        obj = inst.objective(starts, TailNode())
        if obj < best.objective:
            best = Found(obj, starts)
    return best if best.objective < inc.objective else None
