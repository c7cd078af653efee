"""Exact dynamic program for contiguous pipeline partitioning with memory limits.

Problem.  Split units 0..n-1 into p contiguous non-empty stages and choose m (micro-batches) to
minimise the GPipe step time of :mod:`pipeplan.planner.costmodel`,

    T(m, P) = S(P) + (m - 1) M(P) + R(P),
    S = sum_j a_j,  a_j = t_j + (m - 1) k c_j,  M = max_j s_j,  s_j = t_j - k c_j,
    R = max_j E_j,  E_j = ready_j + U_j  (the updates' tail: stage j's update ends E_j after
                                          stage 0's last backward; ready_0 = 0, or A after a
                                          tied all-reduce; ready_j = -D_j for a stage j > 0
                                          that holds no tied copy),

with c_j = F_j + B_j, k the contention (0 when m = 1 or p = 1), U_j stage j's optimizer update
and D_j = sum_{i<j} (B_i + C_i / 2) the drain before it, subject to M_j <= cap_j on every
stage.  The objective mixes a sum and two maxima, so a plain prefix DP is not exact.

The tail: branch and bound over its level.  Write r_j for stage j's E_j as
:meth:`pipeplan.solvers.dp_tables.Instance.tail` computes it (a lower bound where a drain or a tied wait
is only bounded), and for a charged stage k, rho_k = max_{j != k} r_j.  Then R >= (1 - k_u)
max(r_k, rho_k) + k_u sum_j max(r_j, 0), k_u = min(kappa_u, 1) where updates contend and no
parameter is tied, else 0 (:mod:`pipeplan.solvers.dp_tables`); that is the *relaxed* T the DP
minimises.  A node (k, floor f, cap c) covers the partitions with f <= rho_k <= c: charging
stage k (1 - k_u) max(r_k, f), every stage k_u max(r_j, 0), in S and forbidding r_j > c on
every other stage gives, per stage, terms a prefix DP can add up, so the node's minimum V is
exact (:mod:`pipeplan.solvers.dp_threshold`) and bounds every partition it covers from below.  Its minimiser P has rho_k(P) <= c: if its
relaxed T equals V, the node is closed; otherwise it splits into (k, f, rho_k(P)^-) and
(k, rho_k(P), c), both bounded by V.  The root charges stage 0 with nothing capped; if it does
not close, the stage whose tail decides R at its minimiser (a tied LM head's last stage, say)
becomes the charged one and a new root over every partition starts from the first one's bound,
so that the tail that decides R counts in full rather than through a floor.  Nodes are taken
lowest bound first and dropped once their bound reaches the incumbent (the best exact step
time over every m) or the least relaxed T of a plan found (where the relaxation falls short,
the relaxed optimum is then known, and it is the bound); each split moves a floor or a cap
past a value some stage's tail takes, so the search ends, in practice after one to three nodes
(most stages drain far longer than they update, so R is stage 0's update, or the tied
all-reduce and the longer of the end stages').
Past ``_NODES`` nodes (more on small instances) the plan keeps a proven gap.

Two stages have one cut, which fixes every term: they are enumerated (:func:`_two_stages`),
exactly, with the contended tail too.  With three or more the relaxed tail is the true one when
``Instance.exact`` (no update contention, a free link or no updates beyond stage 1's drain,
tied parameters owned by unit 0); otherwise the plan is proven optimal only where the bound
meets it, and carries its gap.

The micro-batch counts are solved in the order of a lower bound of each (:func:`floor`: the
compute every partition pays, the bottleneck's min-max and the end stages' tails), and an m
whose bound cannot beat the incumbent is skipped.

Allowed cuts (``PlanOptions.allowed_cuts``, where a target framework can cut): a stage's cells
l..r are valid only where a stage may start at r + 1, and the last stage only at an allowed L,
so every table, bound and search above ranges over the allowed partitions alone.

Restrictions: the devices must share one speed (their memories may differ); pinned units and
per-stage unit counts are CP-SAT features (:mod:`pipeplan.solvers.cpsat`).
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from pipeplan.planner.errors import InfeasiblePlanError, UnsupportedConstraintError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.solvers.dp_tables import INF, Instance, TailNode
from pipeplan.solvers.dp_threshold import Incumbent, Start, floor, prepare, search
from pipeplan.solvers.request import ResolvedRequest, resolve_request

__all__ = ["partition_dp", "solve_dp"]

_NODES = 64
_NODE_WORK = 4096
"""Most tail nodes solved per m: max(_NODES, _NODE_WORK / (n p)), so small instances always
finish; past it the plan keeps a proven gap."""


def _solve(inst: Instance, start: Start, inc: Incumbent, bound: float) -> float:
    """Search one m's partitions, offering every plan met to ``inc``; returns a lower bound of
    this m's optimum (the incumbent's step time where nothing here can beat it).  ``bound``
    (a lower bound of the m's optimum) ranks the root node."""
    if inst.p == 2 and inst.tail_on:
        return _two_stages(inst, inc)
    if inst.p == 1 or not inst.tail_on:
        search(inst, TailNode(), start, inc)  # exact: without a tail, T is the node's objective
        return inc.objective
    least = INF  # the least bound of the nodes closed
    relaxed = INF  # the least relaxed objective of a plan found: no node above it matters
    heap = [(bound, 0, TailNode())]
    made = 1
    for _ in range(max(_NODES, _NODE_WORK // (inst.n * inst.p))):
        if not heap or heap[0][0] >= min(inc.objective, relaxed):
            break
        _, _, node = heapq.heappop(heap)
        found = search(inst, node, start, inc)
        if found is None:  # nothing it covers beats the incumbent
            continue
        relaxed = min(relaxed, inst.relaxed(found.starts))
        closed, rho = inst.closes(found.starts, node)
        if closed:
            least = min(least, found.objective)
            continue
        if made == 1:
            # The root charged stage 0, and another stage's tail is longer at its minimiser:
            # charge that stage instead (its tail then counts in full where it decides R).
            # The root's minimum bounds the new root, which covers every partition too.
            k = int(np.argmax(inst.tails(found.starts)[1:])) + 1
            heap = [(found.objective, made, TailNode(inst.r0_min, INF, k))]
            made += 1
            continue
        for child in (
            TailNode(node.floor, float(np.nextafter(rho, -INF)), node.charged),
            TailNode(rho, node.cap, node.charged),
        ):
            heapq.heappush(heap, (found.objective, made, child))
            made += 1
    open_bound = heap[0][0] if heap else INF
    return min(least, open_bound, relaxed, inc.objective)


def _two_stages(inst: Instance, inc: Incumbent) -> float:
    """p = 2 with a tail: the single cut L decides both stages, so every L where both fit is
    evaluated exactly (at most n - 1 closed forms; no tail bound to search)."""
    V, _ = inst.run_mid(INF, "sum")  # stage 0 over units 0..L-1: finite where it fits
    best = INF
    for L in np.flatnonzero(np.isfinite(V + inst.t_last)):
        inc.offer(inst, (0, int(L)))
        best = min(best, inst.step_time((0, int(L))))
    return min(best, inc.objective)


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
    req = resolve_request(profile, cluster, options)
    insts = [Instance(req, unit_costs(profile, m)) for m in req.microbatches]
    # The most promising m first: its step time then cuts the other m's searches short, or
    # skips them.
    starts = [prepare(inst) for inst in insts]
    floors = [floor(inst, start) for inst, start in zip(insts, starts)]
    inc = Incumbent()
    bound = INF
    for i in sorted(range(len(insts)), key=lambda i: (floors[i], insts[i].m)):
        if floors[i] >= inc.objective:
            bound = min(bound, floors[i])
            continue
        bound = min(bound, _solve(insts[i], starts[i], inc, floors[i]))
    mixed = any(inst.auto for inst in insts)  # some m where some stage cannot keep
    if mixed and bound < inc.objective * (1 - 1e-12):
        # The tail's bound left a gap (the drain of a mixed plan is bounded, see dp_tables):
        # offer the optimum of every fixed policy too, each a choice auto can make, so that
        # auto is never worse than the best of them.  (Where every stage can keep, auto's
        # tables are never's and its gap is never's own.)
        by_m = {inst.m: inst for inst in insts}
        for policy in ("never", "except_last", "always"):
            fixed = _partition(profile, cluster, options.model_copy(update={"checkpoint": policy}))
            if fixed is not None and fixed[1] in by_m:
                inc.offer(by_m[fixed[1]], fixed[0])
    if not inc.starts:
        return None
    by_m = {inst.m: inst for inst in insts}
    best = _balanced(req, by_m[inc.m], inc.starts, inc.objective)
    objective = by_m[inc.m].step_time(best)  # to rounding, the optimum's
    return best, inc.m, objective, min(bound, objective)


def _balanced(
    req: ResolvedRequest, inst: Instance, starts: tuple[int, ...], objective: float
) -> tuple[int, ...]:
    """Among the partitions as fast as ``starts`` (to 1e-12, the
    tolerance of a proof), the most balanced one that fits,
    by moving one cut to the next allowed start on either side (``PlanOptions.allowed_cuts``)
    while the stages' busy times, largest first, shrink lexicographically (a strict decrease
    each move, so it ends).

    At m = 1 (or wherever the step time does not depend on a cut) every partition can tie,
    and the DP's first optimum is arbitrary: it put one parameter-free activation on a stage
    of its own (issue 31); a balanced plan does the same step and leaves room for a larger m.
    """

    def key(s: tuple[int, ...]) -> list[float]:
        return sorted(inst._stages(s)[0], reverse=True)

    allowed = [b for b, ok in enumerate(req.allowed) if ok and 0 < b < inst.n]
    best, best_key = starts, key(starts)
    moved = True
    while moved:
        moved = False
        for j in range(1, len(best)):
            below = [b for b in allowed if b < best[j]]
            above = [b for b in allowed if b > best[j]]
            for b in below[-1:] + above[:1]:
                cand = (*best[:j], b, *best[j + 1 :])
                if not all(a < b for a, b in zip(cand, [*cand[1:], inst.n])):
                    continue
                if inst.step_time(cand) > objective * (1 + 1e-12):
                    continue
                k = key(cand)
                if k < best_key and _fits(req, cand, inst.m):
                    best, best_key, moved = cand, k, True
    return best


def _fits(req: ResolvedRequest, starts: tuple[int, ...], m: int) -> bool:
    plan = evaluate(req.profile, req.cluster, req.options, starts[1:], m, solver="dp")
    return plan.feasible


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

    >>> from pipeplan.profiler.synthetic import synthetic_profile
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
