"""The multi-chunk schedule solver: family, chunks per rank v, cuts into p v chunks, m and
per-chunk recomputation, chosen together under each device's memory and scored by torch's own
order.

Formulation.  For every candidate (family, v, m) that torch's class accepts
(:func:`pipeplan.planner.families.check`) the step time of a partition into k = p v chunks
starting at ``starts`` with recompute flags rho is the replay's makespan
T(family, v, m, starts, rho) (:mod:`pipeplan.solvers.chunks`), feasible when every rank's peak
walked along the same order fits its device.  We minimise T over all of them.

Algorithm.
  0. Candidates (the request's families, v with p v units at least, and m) are taken in the
     order of their lower bound L_c = :func:`~pipeplan.solvers.schedule_bounds.family_bound`;
     one whose bound reaches the best step found so far is dropped before torch is asked whether
     it accepts it (:func:`pipeplan.planner.families.check`, which builds the schedule).
  1. Each candidate left is seeded (:mod:`pipeplan.solvers.schedule_search`: the exact min-max
     partition over the allowed cuts, torchtitan's equal split, rank-balanced fills, 1F1B's
     stages cut in v, and for GPipe and 1F1B the closed-form DP's plan), each seed with the
     flags of :func:`~pipeplan.solvers.fit.fits` (none; then, while a rank is over its
     memory, its chunk with the most held bytes recomputes: "largest first").
  2. If the candidates' cut combinations over the allowed cuts number at most
     ``exhaustive_limit``, enumerate every cut and every recompute mask (in the fused
     families only the minimal fitting ones: there recomputing never shortens an action), a
     partition skipped where its busiest rank's compute (:class:`_Floor`) reaches the
     incumbent and a candidate where L_c does; a budget of 8 ``exhaustive_limit`` partitions
     and masks (a count, not a clock) bounds it.  Finished, the answer is ``optimal`` under the
     simulator.
  3. Otherwise (or when the budget runs out) the four best candidates and every other
     family's best get the iterated local search of :mod:`pipeplan.solvers.schedule_search`,
     in equal shares of ``search_work`` actions replayed (a count again, the replays'
     actions summed, which is what a replay costs: the same request gives the same plan on
     any machine; a share left unused passes on; ``options.time_limit_s``, when given, also
     stops it by the clock, which does not), the flags re-fitted after each
     move.  In the split families recomputation is also a speed choice (a recomputing
     chunk runs its backward fused, B_rc against I + W): each searched candidate's flags are
     then flipped one at a time while the replayed step falls, and its cuts searched again
     under them (:func:`_speed_flags`, ``SEARCH_WORK // SPEED_SHARE`` more actions).
     Where memory forced the best plans of searched candidates to recompute, the cuts of the
     first ``REFIT_TOP`` of them (in the order of their seeds) are searched once more from
     their best, each partition scored under the better of two fits
     (:func:`~pipeplan.solvers.fit.fits`: "largest first", and each rank over its memory
     recomputing the set of its chunks that fits it with the least added work),
     ``SEARCH_WORK // REFIT_SHARE`` more actions: a search that only adds, so no plan is
     slower than without it.  The plan is ``feasible`` with the gap (T - L) / T,
     L = min over the candidates of L_c, which holds for every family, v, partition and mask
     (proof in :func:`family_bound`).
  4. With ``exact_time`` > 0 (off by default), each candidate whose bound is below the best
     step gets the exact model of :mod:`pipeplan.solvers.exact_order` in bound order,
     warm-started from its search's best, for that much of CP-SAT's deterministic time (a
     count again), only on plans below the best step: what it finds is replayed, and L_c
     rises to CP-SAT's bound.  ``optimal`` when every candidate is proven (its optimum, or
     no plan below the best) or bounded at the best step.
  5. The final gap: the candidates' bounds are raised by the chains of torch's order
     (:mod:`pipeplan.solvers.final_gap`), which are too costly to order or prune candidates
     by, within work counts that ``exact_time`` raises (the chains' work 1 + ``exact_time``
     times the default; ``exact_time`` more of CP-SAT's time a candidate for their integer
     programme); the plan is the one steps 1-4 found.

Allowed cuts (``PlanOptions.allowed_cuts``, ``pipeplan plan --for``) and ``min_units`` /
``max_units`` per chunk are kept by every step; pinned units are refused.

Cost: a replay is O(k m) actions (about 2 ms at p = 8, v = 2, m = 8); a chunk's costs are
memoised per (chunk, units, flag), so a move re-prices only the chunks it changed (the
replay itself runs whole).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import combinations
from math import comb
from typing import cast

import numpy as np

from pipeplan.planner.errors import (
    InfeasiblePlanError,
    InvalidRequestError,
    PipeplanError,
    UnsupportedConstraintError,
)
from pipeplan.planner.families import FAMILIES, action_order, check
from pipeplan.planner.io import format_bytes
from pipeplan.planner.replay import ChunkCosts, Replay, peak_memory
from pipeplan.planner.types import (
    Cluster,
    Plan,
    PlanOptions,
    Profile,
    ScheduleName,
    WeighedFamily,
)
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.solvers.chunk_plan import chunk_plan
from pipeplan.solvers.chunks import ChunkPlan, fixed_flags, has_split_backward, refuse_split
from pipeplan.solvers.exact_plan import Candidate, prove_candidates
from pipeplan.solvers.final_gap import MODEL_TIME, raise_bounds
from pipeplan.solvers.fit import fits
from pipeplan.solvers.request import ResolvedRequest
from pipeplan.solvers.schedule_bounds import family_bound
from pipeplan.solvers.schedule_search import (
    Cuts,
    Score,
    balanced_seeds,
    local_search,
    minmax_starts,
    require,
    snap_uniform,
)

__all__ = [
    "SEARCH_WORK",
    "Candidate",
    "candidates",
    "schedule_floor",
    "solve_schedule",
    "weighed",
]

#: Actions the local search may replay, summed over its replays (step 3 of the module
#: docstring): 2 M is about 1300 replays of the 7B profile's 226 refined units at p = 8 (v = 4,
#: m = 16), 2 s on the benchmarks' 2-core host (k = 0; about 5 times that with a compute
#: contention k > 0, whose replay steps from event to event).
SEARCH_WORK = 2_000_000

#: The split families' recompute-for-speed step (:func:`_speed_flags`) replays up to
#: ``SEARCH_WORK // SPEED_SHARE`` more actions, over the candidates the search kept.
SPEED_SHARE = 4

#: The refit search (module docstring, step 3): ``SEARCH_WORK // REFIT_SHARE`` more actions
#: over the first ``REFIT_TOP`` candidates (in the order of their seeds) whose best plan
#: recomputes.
REFIT_SHARE, REFIT_TOP = 16, 2

Scored = tuple[float, list[int], list[bool], Replay]


def candidates(
    profile: Profile, cluster: Cluster, options: PlanOptions, chunks: int | None = None
) -> list[Candidate]:
    """Every (family, v, m) the request allows and torch accepts (v = ``chunks`` alone when
    given)."""
    cands, why = _requested(profile, cluster, options, chunks)
    out: list[Candidate] = []
    for c in cands:
        reason = check(c[0], cluster.n_stages, c[1], c[2])
        if reason is None:
            out.append(c)
        else:
            why.append(reason)
    if not out:
        raise InvalidRequestError("no schedule can run this request: " + "; ".join(why[:3]))
    return out


def _requested(
    profile: Profile, cluster: Cluster, options: PlanOptions, chunks: int | None = None
) -> tuple[list[Candidate], list[str]]:
    """Every (family, v, m) the request allows with p v chunks of at least one unit, before
    torch is asked (building its schedule object costs milliseconds); and why others are not."""
    n, p = profile.n_units, cluster.n_stages
    if options.schedule == "auto":
        split = has_split_backward(profile)
        allowed: tuple[str, ...] = options.families or tuple(FAMILIES)
        families = [f for f in allowed if split or not FAMILIES[f].split_backward]
    else:
        refuse_split(profile, options.schedule)
        families = [options.schedule]
    out: list[Candidate] = []
    why: list[str] = []
    for fam in families:
        for v in FAMILIES[fam].v:
            if chunks is not None and v != chunks:
                why.append(f"{fam} runs v = {v}, not the {chunks} chunks per rank asked")
                continue
            if p * v > n:
                why.append(f"{fam} with v = {v} needs {p * v} units (the profile has {n})")
                continue
            out.extend((fam, v, m) for m in microbatch_choices(profile, options))
    return out, why


@dataclass
class _Work:
    """Actions replayed so far, over every candidate's search: what the budget counts."""

    done: int = 0


class _Search:
    """One candidate's partitions, scored once each: (step or inf, busy largest first, the
    busiest rank), with the flags and the replay of each; each replay adds its actions to
    ``work``."""

    def __init__(self, cp: ChunkPlan, work: _Work) -> None:
        self.cp = cp
        self.seen: dict[tuple[int, ...], tuple[Score, list[bool], Replay]] = {}
        self.work = work
        self.actions = sum(len(r) for r in action_order(cp.family, cp.p, cp.v, cp.m))
        """Actions in one replay: what it costs."""
        self.tight = False
        """Whether a partition scored had to recompute to fit."""
        self.refit: set[tuple[int, ...]] = set()
        """The partitions scored with both fits of :func:`~pipeplan.solvers.fit.fits`."""

    def score(
        self, starts: Sequence[int], rc: Sequence[bool] | None = None, *, least: bool = False
    ) -> Score:
        """The partition's score under ``rc``, or under the flags of
        :func:`~pipeplan.solvers.fit.fits` (with ``least``, the better of its two fits); the
        best it has had, memoised."""
        key = tuple(starts)
        if key not in self.seen or rc is not None or (least and key not in self.refit):
            fitted: list[tuple[list[bool], ChunkCosts | None, tuple[int, ...] | None]]
            if rc is None:
                fitted = list(fits(self.cp, starts, least))
                self.tight = self.tight or any(fitted[0][0])
                if least:
                    self.refit.add(key)
            else:
                fitted = [(list(rc), None, None)]
            for flags, costs, peaks in fitted:
                self.work.done += self.actions
                rep = self.cp.replay(starts, flags, costs=costs, peaks=peaks)
                T = rep.makespan_s if self.cp.fits(rep) else np.inf
                busy = rep.busy
                s: Score = (T, tuple(sorted(busy, reverse=True)), int(np.argmax(busy)))
                if key in self.seen and self.seen[key][0] <= s:
                    continue
                self.seen[key] = (s, flags, rep)
        return self.seen[key][0]

    def best(self) -> tuple[list[int], Score, list[bool], Replay]:
        key = min(self.seen, key=lambda k: self.seen[k][0])
        s, rc, rep = self.seen[key]
        return list(key), s, rc, rep


class _Floor:
    """The busiest rank's compute under any recompute flags, each chunk at the least of its
    plain F + B, its recomputing F + B and (split families, chunks s > 0) F + I + W, two
    engine overheads per chunk and micro-batch: a lower bound on the replay's step (every
    rank runs its actions one at a time after the step overhead), from prefix sums alone."""

    def __init__(self, cp: ChunkPlan) -> None:
        c, o = cp.costs, cp.cluster.engine_overhead_s
        self.cp = cp
        self.plain = c.Pf + c.Pg
        self.rc = c.Pfc + c.Pr
        self.rc_call = c.call_f + c.call_b
        self.split = cp.Pi + cp.Pw + c.Pf if cp.split else None
        self.loss = c.loss_f + c.loss_g
        self.speed = np.array([cp.cluster.devices[q].speed for q in cp.owner])
        self.extra = cp.cluster.step_overhead_s
        self.o2 = 2 * o

    def __call__(self, starts: Sequence[int]) -> float:
        a = np.asarray(starts)
        b = np.append(a[1:], self.cp.costs.n)
        least = np.minimum(self.plain[b] - self.plain[a], self.rc[b] - self.rc[a] + self.rc_call)
        if self.split is not None:
            iw = self.split[b] - self.split[a]
            least[1:] = np.minimum(least[1:], iw[1:])
        least[-1] += self.loss
        per = least / self.speed + self.o2
        busy = np.bincount(self.cp.owner, weights=per, minlength=self.cp.p)
        return float(self.cp.m * busy.max()) + self.extra


def _exhaustive(
    cp: ChunkPlan, k: int, cuts: Cuts, incumbent: float, budget: list[int]
) -> tuple[Scored | None, bool, bool]:
    """Every allowed cut and every recompute mask, pruned by bounds only: a partition whose
    busiest rank (:class:`_Floor`) cannot beat ``incumbent`` is skipped, and, in the fused
    families, so is a mask that is a superset of one that fits (a fixed-order schedule's
    makespan never falls when an action grows, and there recomputing never makes an action
    shorter: :func:`pipeplan.planner.unitcosts.unit_costs` clips fc >= f and r >= g).  In the
    split families it can: a recomputing chunk runs its backward fused, as one I of B_rc
    seconds and no W, which is shorter than I + W where the split backward costs more than the
    fused one.  There the minimal masks are enumerated first (an incumbent), then every mask,
    when the cut combinations times 2^k fit what is left of the budget.  Memory (the walk
    alone) is checked before any replay.

    Returns the best found below ``incumbent``, whether the enumeration ended within
    ``budget[0]`` partitions and masks looked at (spent from it: a count, not a clock, so that
    whether a plan is proven does not depend on the load), and whether it proved the
    candidate (every mask looked at)."""
    best, done = _enumerate(cp, k, cuts, incumbent, budget, every_mask=False)
    fixed = fixed_flags(cp.options, k) is not None
    if not done or not cp.split or fixed:
        return best, done, done
    if comb(len(cuts.positions) - 2, k - 1) << k > budget[0]:
        return best, True, False  # too many masks to prove: the local search takes over
    more, done = _enumerate(
        cp, k, cuts, min(incumbent, best[0] if best else np.inf), budget, every_mask=True
    )
    return more or best, done, done


def _enumerate(
    cp: ChunkPlan, k: int, cuts: Cuts, incumbent: float, budget: list[int], every_mask: bool
) -> tuple[Scored | None, bool]:
    """:func:`_exhaustive`'s enumeration: the minimal fitting masks of each partition, or
    (``every_mask``) all of them."""
    best: Scored | None = None
    fixed = fixed_flags(cp.options, k)
    limits = [d.memory_bytes for d in cp.cluster.devices]
    floor = _Floor(cp)
    for cuts_ in combinations(cuts.positions[1:-1], k - 1):
        budget[0] -= 1
        if budget[0] < 0:
            return best, False
        starts = [0, *cuts_]
        if not cuts.valid(starts):
            continue
        if floor(starts) >= min(incumbent, best[0] if best else np.inf):
            continue
        fitting: list[tuple[bool, ...]] = []
        for rc in [tuple(fixed)] if fixed is not None else _masks(k):
            budget[0] -= 1
            if budget[0] < 0:
                return best, False
            if not every_mask and any(
                all(r or not f for r, f in zip(rc, fit, strict=True)) for fit in fitting
            ):
                continue  # a superset of a mask that fits: never faster (fused families)
            costs = cp.costs_of(starts, rc)
            if every_mask and _busiest(cp, costs) >= min(incumbent, best[0] if best else np.inf):
                continue
            if any(
                pk > lim
                for pk, lim in zip(
                    peak_memory(cp.family, cp.p, cp.v, cp.m, costs), limits, strict=True
                )
            ):
                continue
            fitting.append(rc)
            cand = _scored(cp, starts, list(rc))
            if cand[0] < min(incumbent, best[0] if best else np.inf):
                best = cand
            if not any(rc) and not every_mask:
                break  # no chunk recomputes and it fits: every other mask is a superset
    return best, True


def _stop(work: _Work, share: int, deadline: float | None) -> Callable[[], bool]:
    """A search's stop: once ``work`` has replayed ``share`` actions in all, or at
    ``deadline`` (``time.perf_counter()``) when one is given."""

    def stop() -> bool:
        return work.done >= share or (deadline is not None and time.perf_counter() >= deadline)

    return stop


def _speed_flags(sr: _Search, cuts: Cuts, stop: Callable[[], bool]) -> None:
    """Recompute flags chosen for speed on the search's best partition: flip one chunk's flag
    at a time (either way), keeping a flip while the replayed step falls and memory fits,
    until no flip helps; then the cuts are searched again under those flags
    (:func:`~pipeplan.solvers.schedule_search.local_search`).  Everything is scored into
    ``sr``, whose best is the plan."""
    starts, now, rc, _ = sr.best()
    improved = True
    while improved and not stop():
        improved = False
        for j in range(len(rc)):
            flipped = [not f if t == j else f for t, f in enumerate(rc)]
            got = sr.score(starts, flipped)
            if got[:2] < now[:2]:
                rc, now, improved = flipped, got, True
            if stop():
                break
    if any(rc):
        local_search(starts, lambda st: sr.score(st, rc), sr.cp.owner, cuts, stop, now)


def _busiest(cp: ChunkPlan, costs: ChunkCosts) -> float:
    """The busiest rank's actions under these chunk costs, m of each of its chunks' F and the
    lesser of B and I + W, after the step overhead: a lower bound on this partition and mask's replay
    (every rank runs its actions one at a time)."""
    back = np.asarray(costs.backward_s)
    i, w = costs.backward_input_s, costs.backward_weight_s
    if i is not None and w is not None:  # the first chunk may run B whole: the least of the two
        back = np.minimum(back, np.add(i, w))
    per = np.asarray(costs.forward_s) + back
    busy = np.bincount(cp.owner, weights=per, minlength=cp.p)
    return float(cp.m * busy.max()) + cp.cluster.step_overhead_s


def _masks(k: int) -> Iterator[tuple[bool, ...]]:
    """Every recompute mask of k chunks, fewest recomputing first, made as they are asked for
    (2^k of them: the budget, which counts each, ends an enumeration that would not)."""
    for size in range(k + 1):
        for on in combinations(range(k), size):
            yield tuple(s in on for s in range(k))


def _scored(cp: ChunkPlan, starts: list[int], rc: list[bool]) -> Scored:
    rep = cp.replay(starts, rc)
    return (rep.makespan_s if cp.fits(rep) else np.inf, starts, rc, rep)


def _dp_seeds(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    cands: list[Candidate],
    plans: Sequence[Plan] | None = None,
) -> dict[Candidate, tuple[list[int], list[bool]]]:
    """The closed-form DP's plan for gpipe and 1f1b (:mod:`pipeplan.solvers.dp`), as seeds:
    ``plans`` where the caller has solved them already (:func:`pipeplan.solvers.choose.solve`
    under ``auto``), else solved here."""
    from pipeplan.solvers.dp import solve_dp

    given = None if plans is None else {pl.schedule: pl for pl in plans}
    out = {}
    for fam in ("gpipe", "1f1b"):
        if not any(c[0] == fam for c in cands):
            continue
        if given is not None:
            if fam not in given:  # the DP had no plan for it
                continue
            plan = given[fam]
        else:
            try:
                plan = solve_dp(profile, cluster, options.model_copy(update={"schedule": fam}))
            except PipeplanError:
                continue
        c = (fam, 1, plan.microbatches)
        if c in cands:
            out[c] = ([0, *plan.boundaries], [st.recompute for st in plan.stages])
    return out


def _seeds(
    cp: ChunkPlan, k: int, cuts: Cuts, stages: list[list[int]], light: bool = False
) -> list[list[int]]:
    """The seeds of :mod:`pipeplan.solvers.schedule_search` for one candidate (``light``: the
    min-max one alone, an incumbent for the enumeration)."""
    c = cp.costs
    w = c.f + c.g
    w[-1] += c.loss_f + c.loss_g
    speeds = [d.speed for d in cp.cluster.devices]
    out = [minmax_starts(w, k, cuts)]
    if light:
        return [s for s in out if s is not None and cuts.valid(s)]
    out.append(snap_uniform(k, cuts))
    out += balanced_seeds(w, cp.owner, speeds, cp.m, cuts)
    v = k // cp.p
    for st in stages:  # a 1F1B plan's stages, each split into v chunks
        split: list[int] = []
        for a, b in zip(st, [*st[1:], cuts.n], strict=True):
            sub = minmax_starts(w[a:b], v, _shift(cuts, a, b))
            if sub is None:
                break
            split += [a + x for x in sub]
        else:
            out.append(split)
    uniq = {tuple(s) for s in out if s is not None and len(s) == k and cuts.valid(s)}
    return [list(s) for s in sorted(uniq)]


def _shift(cuts: Cuts, a: int, b: int) -> Cuts:
    pos = tuple(x - a for x in cuts.positions if a <= x <= b)
    return Cuts(b - a, pos, cuts.min_units, cuts.max_units)


def solve_schedule(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions | None = None,
    *,
    exhaustive_limit: int = 2000,
    search_work: int = SEARCH_WORK,
    chunks: int | None = None,
    dp_plans: Sequence[Plan] | None = None,
    exact_time: float = 0.0,
    final_gap: bool = True,
) -> Plan:
    """The fastest (family, v, cuts, m, recompute) under memory (module docstring); v =
    ``chunks`` alone when given; ``dp_plans``: the DP's GPipe and 1F1B plans of this request
    where the caller has them (seeds; solved here otherwise); ``exact_time`` > 0: step 4,
    that much of CP-SAT's deterministic time per candidate; ``final_gap``: step 5."""
    options = options or PlanOptions(schedule="auto")
    if options.search_work is not None:
        search_work = options.search_work
    exact_time = exact_time or options.prove
    t0 = time.perf_counter()
    deadline = None if options.time_limit_s is None else t0 + options.time_limit_s
    if options.pinned:
        raise UnsupportedConstraintError(
            "the schedule solver cannot pin units to chunks; use --solver cpsat with gpipe or 1f1b"
        )
    requested, why = _requested(profile, cluster, options, chunks)
    n, p = profile.n_units, cluster.n_stages
    cuts = Cuts.of(options, n)
    inner = len(cuts.positions) - 2
    size = sum(comb(inner, p * v - 1) for _, v, _ in requested)
    request = ResolvedRequest(profile, cluster, options)
    plans = {c: ChunkPlan(request, *c) for c in requested}
    bound_of = {c: _candidate_floor(cp) for c, cp in plans.items()}
    dp = _dp_seeds(profile, cluster, options, requested, dp_plans)
    stage_seeds = [s for s, _ in dp.values()]
    searches: dict[Candidate, _Search] = {}
    work = _Work()
    incumbent = np.inf
    for c in sorted(requested, key=bound_of.__getitem__):
        if bound_of[c] >= incumbent:
            continue  # cannot win: torch is not even asked
        reason = check(c[0], p, c[1], c[2])
        if reason is not None:
            why.append(reason)
            continue
        sr = searches[c] = _Search(plans[c], work)
        for st in _seeds(plans[c], p * c[1], cuts, stage_seeds, light=size <= exhaustive_limit):
            sr.score(st)
        if c in dp:
            sr.score(*dp[c])
        if sr.seen:
            incumbent = min(incumbent, sr.best()[1][0])
    if not searches:
        raise InvalidRequestError("no schedule can run this request: " + "; ".join(why[:3]))
    cands = list(searches)
    live = {c: sr for c, sr in searches.items() if sr.seen}
    if not live:
        require(None, p * max(v for _, v, _ in cands), cuts)
    exact = size <= exhaustive_limit
    budget = [exhaustive_limit * 8]
    if exact:
        for c in sorted(cands, key=bound_of.__getitem__):
            if bound_of[c] >= incumbent:
                continue
            found, done, proven_c = _exhaustive(plans[c], p * c[1], cuts, incumbent, budget)
            exact = exact and proven_c
            if found is not None:
                searches[c].score(found[1], found[2])
                live[c] = searches[c]
                incumbent = min(incumbent, found[0])
            if not done:
                break
    if not exact:
        ranked = sorted(live, key=lambda c: live[c].best()[1])
        ranked = [c for c in ranked if np.isfinite(live[c].best()[1][0])]
        top = ranked[:4]  # the four best, and each other family's best
        for c in ranked:
            if all(t[0] != c[0] for t in top):
                top.append(c)
        ranked = [c for c in ranked if c in top]

        start = work.done
        for i, c in enumerate(ranked):
            sr = live[c]
            share = start + search_work * (i + 1) // len(ranked)  # what is unused passes on
            starts, score, _, _ = sr.best()
            local_search(
                starts, sr.score, plans[c].owner, cuts, _stop(work, share, deadline), score
            )
        # recomputation as a speed choice, where it can be one (split families, module docstring)
        # (a candidate whose bound, which holds under any flags, reaches the best step is left)
        now = min((live[c].best()[1][0] for c in ranked), default=np.inf)
        faster = [
            c for c in ranked
            if plans[c].split and fixed_flags(options, p * c[1]) is None and bound_of[c] < now
        ]  # fmt: skip
        start = work.done
        for i, c in enumerate(faster):
            share = start + search_work // SPEED_SHARE * (i + 1) // len(faster)
            _speed_flags(live[c], cuts, _stop(work, share, deadline))
        # where memory forced recomputation, the cuts searched again under the better fit
        tight = [c for c in ranked if live[c].tight and any(live[c].best()[2])][:REFIT_TOP]
        start = work.done
        for i, c in enumerate(tight):
            share = start + search_work // REFIT_SHARE * (i + 1) // len(tight)
            refit = partial(live[c].score, least=True)
            starts = live[c].best()[0]
            local_search(starts, refit, plans[c].owner, cuts, _stop(work, share, deadline))
    proven: set[Candidate] = set()
    if exact_time > 0 and not exact:  # step 4, warm-started from each search's best
        best = {c: (b[0], b[2], b[1][0]) for c, sr in searches.items() if sr.seen
                for b in [sr.best()]}  # fmt: skip
        proof = prove_candidates(plans, {c: bound_of[c] for c in searches}, best, exact_time)
        for c, (cut, flags) in proof.found.items():
            searches[c].score(cut, flags)
            live[c] = searches[c]
        bound_of.update(proof.bounds)
        proven = proof.proven
    best_c = min(live, key=lambda c: live[c].best()[1])
    starts, score, rc, rep = live[best_c].best()
    T = score[0]
    if not np.isfinite(T):
        c = min(live, key=lambda c: max(live[c].best()[3].peak_bytes))
        peaks = live[c].best()[3].peak_bytes
        q = max(range(p), key=lambda r: peaks[r] / cluster.devices[r].memory_bytes)
        raise InfeasiblePlanError(
            f"no schedule, cuts or recomputation fits the devices' memory; the least peak "
            f"found needs {format_bytes(max(peaks))} per device ({c[0]}, v = {c[1]}, "
            f"m = {c[2]}: rank {q} needs {format_bytes(peaks[q])} of its "
            f"{format_bytes(cluster.devices[q].memory_bytes)})",
            min_memory_bytes=int(max(peaks)),
        )
    # the final gap: the bounds too costly to order or prune candidates by (final_gap)
    seeds = {c: (list(sr.best()[0]), list(sr.best()[2])) if sr.seen else None
             for c, sr in searches.items()}  # fmt: skip
    if final_gap:
        bound_of = raise_bounds(
            profile, cluster, options, bound_of, seeds, T, effort=1 + exact_time,
            model_time=MODEL_TIME + exact_time * len(seeds),
        )  # fmt: skip
    # candidates torch refuses cannot run; those skipped had bounds above the incumbent
    bound = min(bound_of[c] for c in requested if c in searches or bound_of[c] >= incumbent)
    exact = exact or all(c in proven or bound_of[c] >= T * (1 - 1e-9) for c in searches)
    plan = chunk_plan(
        plans[best_c],
        starts, rc, rep,
        solver="schedules",
        status="optimal" if exact else "feasible",
        gap=None if exact else max(0.0, (T - bound) / T),
        bound=bound,
        solve_time_s=time.perf_counter() - t0,
    )  # fmt: skip
    if options.schedule != "auto":
        return plan
    return plan.model_copy(update={"weighed": weighed(requested, searches, bound_of)})


def weighed(
    requested: Sequence[Candidate],
    searches: dict[Candidate, _Search],
    bound_of: dict[Candidate, float],
) -> tuple[WeighedFamily, ...]:
    """Each requested family's best plan found, or its closest bound (in the order of
    :data:`~pipeplan.planner.families.FAMILIES`)."""
    out: list[WeighedFamily] = []
    for fam in dict.fromkeys(f for f, _, _ in requested):
        mine = [c for c in requested if c[0] == fam]
        found = [
            (sr.best()[1][0], c)
            for c in mine
            if (sr := searches.get(c)) is not None and sr.seen and np.isfinite(sr.best()[1][0])
        ]
        low = min(bound_of[c] for c in mine)
        if found:
            step, c = min(found)
            out.append(WeighedFamily(family=cast(ScheduleName, fam), stages_per_rank=c[1], microbatches=c[2],
                                     step_time_s=float(step), lower_bound_s=low))  # fmt: skip
        else:
            c = min(mine, key=bound_of.__getitem__)
            out.append(WeighedFamily(family=cast(ScheduleName, fam), stages_per_rank=c[1], microbatches=c[2],
                                     lower_bound_s=low))  # fmt: skip
    return tuple(out)


def schedule_floor(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    """A lower bound on the simulated step of every plan of this request, whatever its family,
    v, m, cuts and recomputation: the least
    :func:`~pipeplan.solvers.schedule_bounds.family_bound` over the candidates (``inf`` when
    none can run).  Cheap (no replay): ``plan --devices`` skips the search of a depth whose
    floor cannot beat the best plan found."""
    requested, _ = _requested(profile, cluster, options)
    return min(
        (family_bound(profile, cluster, options, f, v, m) for f, v, m in requested),
        default=float("inf"),
    )


def _candidate_floor(cp: ChunkPlan) -> float:
    """A lower bound on every partition of one candidate (:func:`family_bound`)."""
    return family_bound(cp.profile, cp.cluster, cp.options, cp.family, cp.v, cp.m)
