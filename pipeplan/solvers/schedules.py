"""The schedule solver: family, chunks per rank v, cuts into p v chunks, m and per-chunk
recomputation, chosen together under each device's memory and scored by torch's own order.

Formulation.  For every candidate (family, v, m) that torch's class accepts
(:func:`pipeplan.planner.schedules.check`) the step time of a partition into k = p v chunks
starting at ``starts`` with recompute flags rho is the replay's makespan
T(family, v, m, starts, rho) (:mod:`pipeplan.planner.chunks`), feasible when every rank's peak
walked along the same order fits its device.  We minimise T over all of them.

Algorithm.
  1. Seed each candidate with the min-max partition of the units' F + B at m
     (:func:`pipeplan.solvers.baselines.minmax_partition`) and the recompute flags of
     :func:`recompute_to_fit` (none; then, while a rank is over its memory, the chunk of that
     rank with the most held bytes recomputes).
  2. If every candidate's space is small (sum over candidates of C(n - 1, k - 1) 2^k at most
     ``exhaustive_limit``), enumerate it all: the answer is ``optimal`` under the simulator.
  3. Otherwise improve the best seeds by local search (move one cut by one unit while the
     makespan falls, the flags re-fitted after each move), and report ``feasible`` with the gap
     (T - L) / T against L = :func:`pipeplan.planner.chunks.work_bound`, which holds for every
     family, v and partition.

Cost: a replay is O(k m) actions; the seeds cost one per candidate, the local search
O(k) replays per pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import combinations, product
from math import comb

import numpy as np

from pipeplan.planner.chunks import ChunkPlan, has_split_backward, refuse_split, work_bound
from pipeplan.planner.costmodel import stage_params, tied_syncs
from pipeplan.planner.errors import InfeasiblePlanError, InvalidRequestError
from pipeplan.planner.evaluate import profile_fields
from pipeplan.planner.replay import Replay, peak_memory
from pipeplan.planner.schedules import FAMILIES, action_order, check
from pipeplan.planner.types import Cluster, MemoryBreakdown, Plan, PlanOptions, Profile, Stage
from pipeplan.planner.types.base import OPTIMIZER_STATES
from pipeplan.planner.unitcosts import microbatch_choices
from pipeplan.solvers.baselines import minmax_partition

__all__ = ["Candidate", "candidates", "recompute_to_fit", "solve_schedule"]

Candidate = tuple[str, int, int]
"""(family, v, m)."""

Scored = tuple[float, list[int], list[bool], Replay]


def candidates(
    profile: Profile, cluster: Cluster, options: PlanOptions, chunks: int | None = None
) -> list[Candidate]:
    """Every (family, v, m) the request allows and torch accepts (v = ``chunks`` alone when
    given)."""
    n, p = profile.n_units, cluster.n_stages
    if options.schedule == "auto":
        split = has_split_backward(profile)
        allowed: tuple[str, ...] = options.families or tuple(FAMILIES)
        families = [f for f in allowed if split or not FAMILIES[f].split_backward]
    else:
        refuse_split(profile, options.schedule)
        families = [options.schedule]
    out, why = [], []
    for fam in families:
        for v in FAMILIES[fam].v:
            if chunks is not None and v != chunks:
                why.append(f"{fam} runs v = {v}, not the {chunks} chunks per rank asked")
                continue
            if p * v > n:
                why.append(f"{fam} with v = {v} needs {p * v} units (the profile has {n})")
                continue
            for m in microbatch_choices(profile, options):
                reason = check(fam, p, v, m)
                if reason is None:
                    out.append((fam, v, m))
                else:
                    why.append(reason)
    if not out:
        raise InvalidRequestError("no schedule can run this request: " + "; ".join(why[:3]))
    return out


def _fixed(options: PlanOptions, k: int) -> list[bool] | None:
    """The recompute flags a fixed ``--checkpoint`` policy sets (``None`` under ``auto``)."""
    policy = options.checkpoint
    if policy == "auto":
        return None
    return [policy == "always" or (policy == "except_last" and s < k - 1) for s in range(k)]


def recompute_to_fit(cp: ChunkPlan, starts: Sequence[int]) -> list[bool]:
    """No chunk recomputes; then, while a rank is over its memory, its chunk with the most held
    bytes does (until all of that rank's do).  A fixed policy's flags as they are."""
    fixed = _fixed(cp.options, len(starts))
    if fixed is not None:
        return fixed
    rc = [False] * len(starts)
    order = action_order(cp.family, cp.p, cp.v, cp.m)
    while True:
        costs = cp.costs_of(starts, rc)
        peaks = peak_memory(order, costs, cp.p)
        over = [q for q, pk in enumerate(peaks) if pk > cp.cluster.devices[q].memory_bytes]
        if not over:
            return rc
        flip = [s for s in range(len(starts)) if cp.owner[s] in over and not rc[s]]
        if not flip:
            return rc
        rc[max(flip, key=lambda s: costs.held_bytes[s])] = True


def _scored(cp: ChunkPlan, starts: list[int], rc: list[bool]) -> Scored:
    rep = cp.replay(starts, rc)
    return (rep.makespan_s if cp.fits(rep) else np.inf, starts, rc, rep)


def _seed(cp: ChunkPlan, k: int) -> Scored:
    c = cp.costs
    starts = minmax_partition(list(c.f + c.g), k)
    return _scored(cp, starts, recompute_to_fit(cp, starts))


def _dp_seeds(
    profile: Profile, cluster: Cluster, options: PlanOptions, cands: list[Candidate]
) -> dict[Candidate, tuple[list[int], list[bool]]]:
    """The closed-form DP's plan for gpipe and 1f1b (:mod:`pipeplan.solvers.dp`), as seeds."""
    from pipeplan.solvers.dp import solve_dp

    out = {}
    for fam in ("gpipe", "1f1b"):
        if not any(c[0] == fam for c in cands):
            continue
        try:
            plan = solve_dp(profile, cluster, options.model_copy(update={"schedule": fam}))
        except (InfeasiblePlanError, InvalidRequestError):
            continue
        c = (fam, 1, plan.microbatches)
        if c in cands:
            out[c] = ([0, *plan.boundaries], [st.recompute for st in plan.stages])
    return out


def _local(cp: ChunkPlan, best: Scored, deadline: float) -> Scored:
    n = cp.costs.n
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for j in range(1, len(best[1])):
            for d in (-1, 1):
                starts = list(best[1])
                starts[j] += d
                if (
                    starts[j] <= starts[j - 1]
                    or (starts[j + 1] if j + 1 < len(starts) else n) <= starts[j]
                ):
                    continue
                cand = _scored(cp, starts, recompute_to_fit(cp, starts))
                if cand[0] < best[0] * (1 - 1e-12):
                    best, improved = cand, True
    return best


def _exhaustive(cp: ChunkPlan, k: int) -> Scored | None:
    """Every cut and every recompute mask.  A fixed-order schedule's makespan never falls when
    an action grows, and recomputing never makes an action shorter, so of the masks that fit
    only the minimal ones (no fitting proper subset) can win: masks go by popcount, supersets
    of a fitting one are skipped, and memory (the walk alone) is checked before any replay."""
    best: Scored | None = None
    order = action_order(cp.family, cp.p, cp.v, cp.m)
    fixed = _fixed(cp.options, k)
    masks = (
        [tuple(fixed)] if fixed is not None else sorted(product((False, True), repeat=k), key=sum)
    )
    limits = [d.memory_bytes for d in cp.cluster.devices]
    for cuts in combinations(range(1, cp.costs.n), k - 1):
        starts = [0, *cuts]
        fitting: list[tuple[bool, ...]] = []
        for rc in masks:
            if any(all(r or not f for r, f in zip(rc, fit, strict=True)) for fit in fitting):
                continue  # a superset of a mask that fits: never faster
            costs = cp.costs_of(starts, rc)
            if any(
                pk > lim for pk, lim in zip(peak_memory(order, costs, cp.p), limits, strict=True)
            ):
                continue
            fitting.append(rc)
            cand = _scored(cp, starts, list(rc))
            if best is None or cand[0] < best[0]:
                best = cand
    if best is None:  # nothing fits: the seed reports the least peak
        return _seed(cp, k)
    return best


def solve_schedule(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions | None = None,
    *,
    exhaustive_limit: int = 4096,
    time_limit_s: float = 4.0,
    chunks: int | None = None,
) -> Plan:
    """The fastest (family, v, cuts, m, recompute) under memory (module docstring); v =
    ``chunks`` alone when given."""
    options = options or PlanOptions(schedule="auto")
    t0 = time.perf_counter()
    cands = candidates(profile, cluster, options, chunks)
    n, p = profile.n_units, cluster.n_stages
    size = sum(comb(n - 1, p * v - 1) * 2 ** (p * v) for _, v, _ in cands)
    exact = size <= exhaustive_limit
    plans = {c: ChunkPlan(profile, cluster, options, c[0], c[1], c[2]) for c in cands}
    results: dict[Candidate, Scored] = {}
    for c, cp in plans.items():
        found = _exhaustive(cp, p * c[1]) if exact else _seed(cp, p * c[1])
        assert found is not None
        results[c] = found
    if not exact:
        for c, seed in _dp_seeds(profile, cluster, options, cands).items():
            found = _scored(plans[c], list(seed[0]), list(seed[1]))
            if found[0] < results[c][0]:
                results[c] = found
        deadline = t0 + (options.time_limit_s or time_limit_s)
        for c in sorted(results, key=lambda c: results[c][0])[:4]:
            if np.isfinite(results[c][0]):
                results[c] = _local(plans[c], results[c], deadline)
    best_c = min(results, key=lambda c: results[c][0])
    T, starts, rc, rep = results[best_c]
    if not np.isfinite(T):
        least = min(max(r[3].peak_bytes) for r in results.values())
        raise InfeasiblePlanError(
            f"no schedule, cuts or recomputation fits the devices' memory; the least peak "
            f"found needs {least / 2**30:.2f} GiB per device"
        )
    bound = work_bound(profile, cluster, options)
    return _plan(
        plans[best_c], starts, rc, rep,
        status="optimal" if exact else "feasible",
        gap=None if exact else max(0.0, (T - bound) / T),
        bound=bound,
        solve_time_s=time.perf_counter() - t0,
    )  # fmt: skip


def _plan(
    cp: ChunkPlan,
    starts: list[int],
    rc: list[bool],
    rep: Replay,
    *,
    status: str,
    gap: float | None,
    bound: float,
    solve_time_s: float,
) -> Plan:
    profile, cluster, m = cp.profile, cp.cluster, cp.m
    costs = cp.costs_of(starts, rc)
    n, k = profile.n_units, len(starts)
    order = action_order(cp.family, cp.p, cp.v, m)
    flight = [0] * k
    live = [0] * k
    for acts in order:
        for a in acts:
            live[a.stage] += 1 if a.kind == "F" else (-1 if a.kind in "BW" else 0)
            flight[a.stage] = max(flight[a.stage], live[a.stage])
    states = OPTIMIZER_STATES[cp.options.optimizer]
    stages = []
    for s, l in enumerate(starts):
        r = (starts[s + 1] if s + 1 < k else n) - 1
        q = cp.owner[s]
        dev = cluster.devices[q]
        params = int(stage_params(cp.costs, l, r))
        parts = {
            "params": params,
            "grads": params,
            "optimizer": states * params,
            "stashed_inputs": int(m * cp.costs.x[l]),
            "gradient_buffers": int(m * cp.costs.x[r + 1]),
            "activations": flight[s] * costs.held_bytes[s],
            "transient": costs.transient_bytes[s],
        }
        F, B, C = costs.forward_s[s], costs.backward_s[s], costs.comm_s[s]
        stages.append(
            Stage(
                index=s,
                device=dev.name,
                first_unit=l,
                last_unit=r,
                unit_names=tuple(u.name for u in profile.units[l : r + 1]),
                recompute=rc[s],
                forward_s=F,
                backward_s=B,
                comm_s=C,
                backward_input_s=costs.backward_input_s[s] if costs.backward_input_s else None,
                backward_weight_s=costs.backward_weight_s[s] if costs.backward_weight_s else None,
                time_s=F + B + C,
                update_s=costs.update_s[s],
                memory=MemoryBreakdown(**parts, total=sum(parts.values())),
                memory_limit=dev.memory_bytes,
                feasible=rep.peak_bytes[q] <= dev.memory_bytes,
            )
        )
    shared = [(sp.bytes, sp.units) for sp in profile.shared_params]
    T = rep.makespan_s
    return Plan(
        **profile_fields(profile, m),
        schedule=cp.family,  # type: ignore[arg-type]
        stages_per_rank=cp.v,
        rank_peak_bytes=rep.peak_bytes,
        checkpoint=cp.options.checkpoint,
        optimizer=cp.options.optimizer,
        cluster=cluster,
        stages=tuple(stages),
        tied_syncs=tuple(tied_syncs(shared, cluster, starts)),
        step_time_s=T,
        simulated_step_time_s=T,
        bubble_fraction=rep.bubble_fraction,
        throughput=profile.batch_size / T if T > 0 else 0.0,
        feasible=True,
        solver="schedules",
        status=status,  # type: ignore[arg-type]
        gap=gap,
        lower_bound_s=bound,
        solve_time_s=solve_time_s,
    )
