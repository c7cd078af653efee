"""Lower bounds on the step of every partition of a schedule family: the schedule solver's floor.

:func:`work_bound` holds for every family, chunks per rank v, partition and recomputation;
:func:`family_bound` for every partition of one (family, v, m).  The schedule solver
(:mod:`pipeplan.solvers.multichunk`) visits candidates in the order of their bound, skips those
whose bound cannot beat its best step, and reports its gap to the least of them.  Both read
the chunk costs of :mod:`pipeplan.solvers.chunks` and hold for the replay of
:mod:`pipeplan.planner.replay` (proofs in each docstring).
"""

from __future__ import annotations

import itertools

import numpy as np

from pipeplan.planner.families import rank_of_stage
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import microbatch_choices, unit_costs
from pipeplan.planner.updates import update_cost
from pipeplan.solvers.chunks import has_split_backward
from pipeplan.solvers.path_bound import ONE_CHUNK_FAMILIES, one_chunk_bound

__all__ = ["family_bound", "work_bound"]


def _least(profile: Profile, m: int) -> tuple[np.ndarray, float]:
    """s_u at m (the least of f + g, the recomputing pair and f + i + w) and the loss's f + g."""
    c = unit_costs(profile, m)
    least = np.minimum(c.f + c.g, np.diff(c.Pfc) + np.diff(c.Pr))
    if has_split_backward(profile):
        ts = [u.timings[profile.batch_size // m] for u in profile.units]
        iw = np.array([t.backward_input_s + t.backward_weight_s for t in ts])  # type: ignore[operator]
        least = np.minimum(least, c.f + iw)
    return least, c.loss_f + c.loss_g


def family_bound(
    profile: Profile, cluster: Cluster, options: PlanOptions, family: str, v: int, m: int
) -> float:
    """A lower bound on the step of every partition and recomputation of ``family`` with v
    chunks per rank and m micro-batches: the larger of :func:`work_bound` at m and, for each
    rank q that must hold an end of the model (the first unit: rank 0; the last: rank p - 1
    in a loop, rank 0 in a V),

        c + D_q + m (sum of its forced units' s_u [+ the loss] + (v - e_q) s_min + 2 v o)
          + sum of U(w_u) / v_q over its forced units

    (:func:`work_bound`'s c, s_u and D_q; e_q the number of forced units, each in its own
    chunk; s_min the least s_u of the other units; o the engine overhead; U the optimizer
    step of w_u parameter bytes, counted only where U never falls as w grows).

    Proof.  Rank q runs m micro-batches through each of its v chunks, each chunk at least one
    unit and two actions (F, then B or I and W) of at least o more each; a forced unit's
    chunk costs at least that unit.  It starts no earlier than c + D_q (:func:`work_bound`)
    and updates each chunk's parameters after its last action, a chunk holding at least its
    forced unit's bytes (U is a sum over chunks; contention only slows it).  Where the model's
    ends are heavy (an embedding and a head, or one big update) this bound is the one that
    shows what a V (both ends on rank 0) or a loop (the head beside another chunk) cannot
    reach, which the work bound never does."""
    p, n = cluster.n_stages, profile.n_units
    least, loss = _least(profile, m)
    fastest = max(d.speed for d in cluster.devices)
    c = unit_costs(profile, m)
    fwd = np.concatenate([[0.0], np.cumsum(np.minimum(c.f, np.diff(c.Pfc)))]) / fastest
    o = cluster.engine_overhead_s
    upd = update_cost(profile, options.optimizer, cluster)
    monotone = all(sl >= 0 for sl, _ in upd.pieces)
    owner = rank_of_stage(family, p, v)
    forced: dict[int, list[int]] = {}
    forced.setdefault(owner[0], []).append(0)
    if n > 1:
        forced.setdefault(owner[-1], []).append(n - 1)
    inner = least[1:-1] if n > 2 else least[:0]
    s_min = float(inner.min()) if len(inner) else 0.0
    crossings = sum(a != b for a, b in itertools.pairwise(owner))
    best = work_bound(profile, cluster, options.model_copy(update={"microbatches": m}), crossings)
    for q, units in forced.items():
        speed = cluster.devices[q].speed
        work = sum(float(least[u]) for u in units) + (loss if n - 1 in units else 0.0)
        work += max(v - len(units), 0) * s_min
        nbytes = [float(c.w[u]) for u in units]
        if len(owner) == 1:  # one chunk holds both ends
            nbytes = [sum(nbytes)]
        update = sum(upd.seconds(b) for b in nbytes) if monotone else 0.0
        t = float(fwd[min(q, n)]) + (m * work + update) / speed + m * 2 * v * o
        best = max(best, t + cluster.step_overhead_s)
    if v == 1 and family in ONE_CHUNK_FAMILIES:
        best = max(best, one_chunk_bound(profile, cluster, options, family, m))
    return best


def work_bound(
    profile: Profile, cluster: Cluster, options: PlanOptions, crossings: int | None = None
) -> float:
    """A lower bound on the step of every family, v, partition and recomputation:

        L = c + min over m of max((m (S_m + X_m) + sum_{q >= 1} v_q D_q + U_min) / sum_q v_q,
                                  S_m / v_max)

    with c the step overhead, S_m = sum_u s_u + the loss's forward and backward at m, s_u the
    least of the unit's plain forward and backward f_u + g_u, its recomputing pair and (where
    measured) f_u + i_u + w_u, and D_q = sum_{u < q} min(f_u, fc_u) / v_max.

    Proof.  Every action's duration is at least the sum of its units' least times (the engine
    overhead and the checkpoint calls' own costs only add), so the ranks' busy times, weighted
    by speed, add up to at least m S_m.  Every rank's actions run one at a time after c, so
    T - c >= busy_q + (rank q's idle before its first action).  Every family places only
    chunks s >= q on rank q (a loop puts q, q + p, ...; a V puts q and 2p - 1 - q), and each
    chunk holds at least one unit, so rank q's first forward, of some micro-batch i, waits for
    the forwards of chunks 0..q-1 of i, one after another: those hold units 0..q-1 at least,
    hence the idle is at least D_q.  Weighting T - c >= busy_q + D_q by v_q and summing gives
    the first term.  The second: one micro-batch's forward and backward pass through every
    unit in order.  Tighter than the work bound alone (D_q = 0) by sum v_q D_q / sum v_q.

    U_min: the ranks' optimizer updates (with their data-parallel collectives,
    :func:`~pipeplan.planner.updates.update_cost`), which the replay runs on each rank after
    its last action, so they add to T - c >= busy_q + D_q + U(W_q) / v_q.  U is the maximum of
    affine pieces (s_k, c_k), so sum_q U(W_q) >= s_k W + p min(c_k, 0) for every piece k (W the
    profile's parameter bytes, which the ranks hold between them at least once; U(0) = 0 >=
    s_k 0 + c_k only where c_k <= 0); U_min is the largest over k.  It is what bounds a
    plan whose step the gradients' all-reduce over many replicas dominates.

    With p > 1 ranks, m times (p - 1) times the cheapest cut's two transfers join m S_m: the
    replay charges a chunk whose output goes to another rank the transfer of its output and of
    that output's gradient (a send in its F, a receive in its B, on the rank's own timeline),
    and at least p - 1 chunk boundaries cross ranks in every family (``crossings`` where the
    caller knows the family and v: :func:`family_bound`'s chunks that sit on another rank than
    the next; X_m: those transfers' seconds, weighted by the slowest rank's speed as the busy
    times are).
    """
    speed = sum(d.speed for d in cluster.devices)
    fastest = max(d.speed for d in cluster.devices)
    total = float(sum(u.param_bytes for u in profile.units))
    pieces = update_cost(profile, options.optimizer, cluster).pieces
    p = cluster.n_stages
    updates = max((sl * total + p * min(c, 0.0) for sl, c in pieces), default=0.0)
    updates = max(updates, 0.0)
    best = np.inf
    for m in microbatch_choices(profile, options):
        c = unit_costs(profile, m)
        least, loss = _least(profile, m)
        work = float(least.sum()) + loss
        fwd = np.concatenate([[0.0], np.cumsum(np.minimum(c.f, np.diff(c.Pfc)))]) / fastest
        ramp = sum(d.speed * float(fwd[min(q, c.n)]) for q, d in enumerate(cluster.devices))
        sends = 0.0
        if p > 1 and c.n > 1:  # every crossing's two transfers, each the cheapest cut's
            nbytes, msgs = c.x[1 : c.n], c.msgs[1 : c.n]
            slowest = min(d.speed for d in cluster.devices)  # seconds weighted by speed
            cheapest = 2.0 * float(np.min(cluster.link.one_way_s(nbytes, msgs)))
            sends = slowest * (p - 1 if crossings is None else crossings) * cheapest
        best = min(best, max((m * (work + sends) + ramp + updates) / speed, work / fastest))
    return float(best) + cluster.step_overhead_s
