"""Plans from the exact multi-chunk model (:mod:`pipeplan.solvers.exact_order`): one (family,
v, m) solved and re-scored by the replay, or refused with the tightest rank and its memory.

The plan's step is the replay's step of the model's winner; its status is ``optimal`` where
CP-SAT proves the model's optimum and the model charges what the replay does (no contention),
the winner then within ``ExactResult.error_s`` (the ticks' rounding) of the best of every
cut and recompute mask.  Otherwise ``feasible``, with the gap (T - L) / T to CP-SAT's bound
L, which holds for every partition of the candidate (a budget that stops the proof, or a
contention the model relaxes).  When no cuts and flags fit, a second model lets every rank
exceed its memory by one variable and minimises it: the error names the tightest rank and
what it would need.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from pipeplan.planner.errors import InfeasiblePlanError, UnsupportedConstraintError
from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.solvers.chunk_plan import chunk_plan
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.exact_order import ExactOrder, ExactResult
from pipeplan.solvers.request import ResolvedRequest

__all__ = ["Proof", "prove_candidates", "solve_exact_order"]


def solve_exact_order(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    family: str,
    v: int,
    m: int,
    *,
    hint: tuple[Sequence[int], Sequence[bool]] | None = None,
    deterministic_time: float | None = None,
) -> Plan:
    """The best cuts and recomputation of ``family`` with v chunks per rank and m
    micro-batches (the module docstring's model), as a :class:`Plan` whose step is the
    replay's: ``optimal`` where CP-SAT proves it and the model is exact, else ``feasible``
    with the gap to CP-SAT's bound.  ``hint``: cuts and flags to start from (kept when the
    budget ends before CP-SAT finds a plan).  No plan fits: :class:`InfeasiblePlanError`
    naming the tightest rank and the memory it would need."""
    t0 = time.perf_counter()
    if options.pinned:
        raise UnsupportedConstraintError("the exact model cannot pin units to chunks")
    cp = ChunkPlan(ResolvedRequest(profile, cluster, options), family, v, m)
    xo = ExactOrder(cp)
    if hint is not None:
        xo.hint(*hint)
    res = xo.solve(deterministic_time)
    if res.replay is None and hint is not None:
        rep = cp.replay(list(hint[0]), list(hint[1]), timeline=True)
        if cp.fits(rep):
            res = ExactResult(list(hint[0]), list(hint[1]), rep.makespan_s, res.bound_s,
                              "feasible", res.exact, res.error_s, rep)  # fmt: skip
    if res.replay is None:
        if res.status == "infeasible":
            _refuse(cp, deterministic_time)
        raise InfeasiblePlanError(
            f"{family} with v = {v}, m = {m}: the budget ended before the exact model found a "
            "plan; give it more (deterministic time) or a hint"
        )
    T = res.replay.makespan_s
    bound = min(res.bound_s, T)
    gap = None if res.status == "optimal" else max(0.0, (T - bound) / T)
    return chunk_plan(
        cp,
        res.starts, res.recompute, res.replay, solver="exact-order", status=res.status,
        gap=gap, bound=bound, solve_time_s=time.perf_counter() - t0,
    )  # fmt: skip


def _refuse(cp: ChunkPlan, deterministic_time: float | None) -> NoReturn:
    """The one line for a request no cuts and flags fit: the tightest rank and its memory."""
    found = ExactOrder(cp, spare=True).least_spare(deterministic_time)
    where = f"{cp.family} with v = {cp.v}, m = {cp.m}"
    if found is None:
        raise InfeasiblePlanError(f"no cuts or recomputation of {where} fit the devices' memory")
    spare, starts, rc = found
    peaks = cp.replay(starts, rc).peak_bytes
    devs = cp.cluster.devices
    q = max(range(cp.p), key=lambda r: peaks[r] - devs[r].memory_bytes)
    raise InfeasiblePlanError(
        f"no cuts or recomputation of {where} fit the devices' memory: the tightest rank, "
        f"{q} ({devs[q].name}), needs {format_bytes(peaks[q])} at least, "
        f"{format_bytes(spare)} over its {format_bytes(devs[q].memory_bytes)}",
        min_memory_bytes=int(max(d.memory_bytes for d in devs) + spare),
    )


Candidate = tuple[str, int, int]
"""(family, v, m)."""


@dataclass
class Proof:
    """What the exact models of a schedule solver's candidates showed."""

    bounds: dict[Candidate, float]
    """Each candidate's lower bound: the larger of the one given and CP-SAT's."""
    found: dict[Candidate, tuple[list[int], list[bool]]] = field(default_factory=dict)
    """Cuts and flags that beat the incumbent, per candidate."""
    proven: set[Candidate] = field(default_factory=set)
    """Candidates none of whose plans beats the incumbent by more than the model's rounding
    (its optimum proven, or no plan below the incumbent)."""


def prove_candidates(
    plans: dict[Candidate, ChunkPlan],
    bounds: dict[Candidate, float],
    best: dict[Candidate, tuple[list[int], list[bool], float]],
    deterministic_time: float,
) -> Proof:
    """The exact model of each candidate, warm-started from ``best`` (its local search's cuts,
    flags and step), only on plans below the incumbent (the least step of ``best``, then of
    what it finds), within ``deterministic_time`` of CP-SAT's work each; a candidate whose
    bound reaches the incumbent is dropped, and one the model refuses (two groups of shared
    parameters with users inside the model) keeps its bound.

    The incumbent's own candidate goes first, the others then in the order of their bounds:
    a plan the first finds below the search's lowers the cutoff under which the rest must be
    refuted, and refuting a candidate takes CP-SAT less the lower the cutoff."""
    proof = Proof(dict(bounds))
    incumbent = min((b[2] for b in best.values()), default=math.inf)
    order = sorted(bounds, key=bounds.__getitem__)
    order.sort(key=lambda c: c not in best or best[c][2] > incumbent)  # stable: the rest by bound
    for c in order:
        if proof.bounds[c] >= incumbent:
            continue
        try:
            xo = ExactOrder(plans[c])
        except UnsupportedConstraintError:
            continue
        if c in best and math.isfinite(best[c][2]):
            xo.hint(best[c][0], best[c][1])
        res = xo.solve(deterministic_time, incumbent if math.isfinite(incumbent) else None)
        proof.bounds[c] = max(proof.bounds[c], res.bound_s)
        if res.status == "optimal" or (res.status == "infeasible" and xo.exact):
            proof.proven.add(c)
        rep = res.replay
        if rep is not None and plans[c].fits(rep) and rep.makespan_s < incumbent:
            proof.found[c] = (res.starts, res.recompute)
            incumbent = rep.makespan_s
    return proof
