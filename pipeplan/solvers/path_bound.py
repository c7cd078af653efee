"""Critical-path lower bounds on the GPipe and 1F1B step, minimised over every partition.

With one chunk per rank (v = 1, stage j on rank j) the replay (:mod:`pipeplan.planner.replay`)
runs each rank's actions one at a time in torch's order
(:func:`pipeplan.planner.families.action_order`), each after its inputs.  So every chain of
actions linked by a rank's order or by a data dependence lasts at most the step.  With stage j
over units l..r at micro-batch count m (the tables of :mod:`pipeplan.solvers.chunks`):

    F'_j = F_j + C_j / 2     its forward and the blocking send of its output
    B'_j = B_j + C_j / 2     the receive of its output's gradient and its backward
    t_j  = F'_j + B'_j       (C_j the round trip across the cut after stage j, 0 for the last;
                              F_j and B_j with the engine's overhead o each, the loss's on the
                              last stage)

and U_0 the update of stage 0's parameters on rank 0 (after its last action), c the step's
overhead before the first action, three chains give, for every partition and every stage j:

    (A) every one-chunk family:  T >= c + sum_{s<j} t_s + m t_j + U_0
        Rank j's first action waits for the forwards of its micro-batch through stages
        0..j-1 (F'_s each); rank j runs its m forwards and m backwards one at a time; after
        its last, a backward B(j, i), the backwards of i through stages j-1..0 (B'_s each)
        follow one another, and then rank 0 updates.
    (B) GPipe:  T >= c + sum_s t_s + (m - 1) t_j + U_0
        F(0..j-1, 0); rank j's m forwards; F(j+1..p-1, m-1); rank p-1's first backward
        B(p-1, 0), which follows its last forward; B(p-2..j+1, 0); rank j's m backwards (its
        first is B(j, 0)); B(j-1..0, m-1); U_0.
    (C) 1F1B:  T >= c + sum_s t_s + (m - 1) B'_j + (m - w_j) F'_j + U_0,  w_j = min(m, p - j)
        Micro-batch 0's forward through every stage and its backward back to stage j + 1;
        rank j's first backward B(j, 0); the rest of rank j's actions: m - 1 backwards and
        the m - w_j forwards torch's 1F1B runs after its first backward (it runs w_j before
        it); B(j-1..0, m-1); U_0.

Every replay charge left out (tied all-reduces before the updates, compute and update
contention, the other ranks' updates) only lengthens the step, so the chains bound it.  Where
the checkpoint policy leaves stage j's recomputation free and the stage can keep its
activations (below), F_j, B_j and t_j each take the least of keeping and recomputing (a
relaxation: the chains then hold for either choice).

Memory: rank j's walk (:func:`pipeplan.planner.replay.peak_memory`) holds, during its first
backward, q_j micro-batches (GPipe: m; 1F1B: w_j), each its output, its activations unless it
recomputes, and the loss's bytes on the last stage, with the backward's transient bytes (its
input's gradient, the activations a recomputing stage remakes, the loss's two on the last
stage) beside its static bytes (its parameters with their optimizer states, and m input and
output buffers); during its second (m > 1), at least q_j - 1 of them beside the gradients the
first made.  A stage for which either exceeds its device keeping its activations recomputes
in every plan that fits, and is priced so; one that exceeds it either way (or the way the
policy fixes) cannot be in a plan that fits, and the programmes below leave it out: the bound
is over the partitions that fit.

The bound is the least over partitions P (the allowed cuts, ``min_units`` and ``max_units``)
of the chains' maximum, relaxed to three dynamic programmes over the allowed cuts:

    L_A = c + min_P [U_0 + max_j (sum_{s<j} t_s + m t_j)]
        exactly: H_j(l) = min over r of max(m t_j(l, r), t_j(l, r) + H_{j+1}(r + 1)), with
        H_{p-1}(l) = m t_{p-1}(l, n - 1), is the least max over j' >= j of the chain from
        stage j on, measured from its start; L_A = c + min over stage 0's end e of
        U_0(e) + max(m t_0(0, e), t_0(0, e) + H_1(e + 1)).
    L_B = c + min_P (sum_s t_s + U_0) + min_P max_j (m - 1) t_j                      GPipe
    L_C = c + min_P (sum_s t_s + U_0) + min_P max_j ((m - 1) B'_j + (m - w_j) F'_j)   1F1B

(minimising the two parts of L_B and L_C apart can only lower them; thresholds on the max
part take back some of that, :func:`least_sum_plus_max`), and :func:`one_chunk_bound`
returns the larger of L_A and the family's own.  Each programme is
O(p a^2) for a allowed starts.  Where chains (A) and (B) or (C) meet the step exactly (balanced
stages whose bottleneck sets the pace, as in ``synth`` and the 7B profile of
``benchmarks/schedules``) the bound is the optimum; memory it sees only stage by stage, so
a plan whose ranks memory forces off the balanced cut, or into recomputing, keeps a gap.
"""

from __future__ import annotations

import itertools

import numpy as np

from pipeplan.planner.collectives import state_factors
from pipeplan.planner.costmodel import stage_params
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import UnitCosts, unit_costs
from pipeplan.planner.updates import update_cost
from pipeplan.solvers.chunks import fixed_flags
from pipeplan.solvers.schedule_search import Cuts

__all__ = [
    "LEVELS",
    "ONE_CHUNK_FAMILIES",
    "cut_transfers",
    "least_sum_plus_max",
    "one_chunk_bound",
]

#: The families :func:`one_chunk_bound` bounds (one chunk per rank, no split backward).
ONE_CHUNK_FAMILIES = ("gpipe", "1f1b")

#: Thresholds of :func:`least_sum_plus_max` for the plan's final gap (each one dynamic
#: programme; :mod:`pipeplan.solvers.multichunk` applies it after its search).
LEVELS = 32


def one_chunk_bound(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    family: str,
    m: int,
    *,
    levels: int = 0,
) -> float:
    """max(L_A, L_B) for GPipe, max(L_A, L_C) for 1F1B (module docstring): a lower bound on the
    replayed step of every partition and recomputation of ``family`` with m micro-batches;
    0 where no partition keeps to the allowed cuts.  ``levels`` > 0: L_B and L_C through that
    many thresholds (:func:`least_sum_plus_max`), tighter, for that many more programmes."""
    if family not in ONE_CHUNK_FAMILIES:
        raise ValueError(f"{family} is not one of {ONE_CHUNK_FAMILIES}")
    fwd, bwd, t, u0 = _tables(profile, cluster, options, family, m)
    p = cluster.n_stages
    c = cluster.step_overhead_s
    chain_a = _chain_a(t, u0, m)
    cost = [t[0] + u0[None, :], *t[1:]]  # the sum's terms, rank 0's update on stage 0
    if family == "gpipe":
        own = [_times(m - 1, tj) for tj in t]
    else:
        own = [_times(m - 1, bwd[j]) + _times(m - min(m, p - j), fwd[j]) for j in range(p)]
    chain_own = _least_sum(cost) + _least_max(own)
    if levels > 0:
        chain_own = max(chain_own, least_sum_plus_max(cost, own, levels))
    best = max(chain_a, chain_own)
    return float(best + c) if np.isfinite(best) else 0.0


def _tables(
    profile: Profile, cluster: Cluster, options: PlanOptions, family: str, m: int
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], np.ndarray]:
    """F'_j, B'_j and t_j of stage j over allowed starts a < b (matrices [a, b], ``inf`` where
    the unit count is not allowed or the stage cannot fit its device; where it fits only
    recomputing, the recomputing times), and U_0 per end of stage 0 (``inf`` at start 0)."""
    c = unit_costs(profile, m)
    cuts = Cuts.of(options, c.n)
    pos = np.asarray(cuts.positions)
    size = pos[None, :] - pos[:, None]
    ok = (size >= max(cuts.min_units, 1)) & (size <= (cuts.max_units or c.n))
    o = cluster.engine_overhead_s
    half = cut_transfers(c, cluster, pos)
    p = cluster.n_stages
    flags = fixed_flags(options, p)

    def span(prefix: np.ndarray) -> np.ndarray:
        at = np.asarray(prefix, dtype=np.float64)[pos]
        return at[None, :] - at[:, None]

    params = span(c.Pw) + c.shared_bytes(pos[:, None], pos[None, :] - 1)
    state = state_factors(options.optimizer, cluster)
    x = np.asarray(c.x, dtype=np.float64)[pos]
    static = params * (state.params + state.optimizer) + m * (x[:, None] + x[None, :])
    grads = params * state.grads
    acts = span(c.Pa)

    keep_f, keep_b = span(c.Pf), span(c.Pg)
    remake_f, remake_b = span(c.Pfc) + c.call_f, span(c.Pr) + c.call_b
    fwd, bwd, tot = [], [], []
    for j in range(p):
        sp = cluster.devices[j].speed
        last = j == p - 1
        ends = float(c.out + c.loss_a) if last else 0.0
        q = m if family == "gpipe" else min(m, p - j)
        cap = cluster.devices[j].memory_bytes + 2.0  # the tables' int() rounding
        into = (x[:, None] if j > 0 else 0.0) + (2.0 * float(c.out) if last else 0.0)
        can_remake = _least_peak(static, grads, q, x[None, :] + ends, acts + into, m) <= cap
        can_keep = _least_peak(static, grads, q, x[None, :] + ends + acts, into, m) <= cap
        if flags is not None:  # the policy decides
            can_keep, can_remake = can_keep & (not flags[j]), can_remake & flags[j]
        send = 0.0 if last else half[None, :]
        # where it cannot keep its activations it recomputes; where it can, the least of both
        remade_f = np.where(can_remake, remake_f, np.inf)
        remade_b = np.where(can_remake, remake_b, np.inf)
        f = np.where(can_keep, np.minimum(keep_f, remade_f), remade_f)
        b = np.where(can_keep, np.minimum(keep_b, remade_b), remade_b)
        both = np.minimum(np.where(can_keep, keep_f + keep_b, np.inf), remade_f + remade_b)
        fits = ok & (can_keep | can_remake)
        f = (f + (c.loss_f if last else 0.0)) / sp + o + send
        b = (b + (c.loss_g if last else 0.0)) / sp + o + send
        both = (both + ((c.loss_f + c.loss_g) if last else 0.0)) / sp + 2 * (o + send)
        fwd.append(np.where(fits, f, np.inf))
        bwd.append(np.where(fits, b, np.inf))
        tot.append(np.where(fits, both, np.inf))
    upd = update_cost(profile, options.optimizer, cluster)
    sp0 = cluster.devices[0].speed
    u0 = np.array([
        upd.seconds(float(stage_params(c, 0, int(e) - 1))) / sp0 if e > 0 else np.inf
        for e in pos
    ])  # fmt: skip
    return fwd, bwd, tot, u0


def cut_transfers(c: UnitCosts, cluster: Cluster, pos: np.ndarray) -> np.ndarray:
    """The one-way transfer across a cut at each allowed start in ``pos`` (0 at the model's
    ends and where nothing crosses): half the round trip C of :mod:`pipeplan.solvers.chunks`."""
    return np.array([
        cluster.link.transfer_s(float(c.x[b]), int(c.msgs[b])) if 0 < b < c.n and c.x[b] > 0 else 0.0
        for b in pos
    ])  # fmt: skip


def _least_peak(
    static: np.ndarray,
    grads: np.ndarray,
    q: int,
    held: np.ndarray,
    trans: np.ndarray | float,
    m: int,
) -> np.ndarray:
    """Two points of rank j's walk: its first backward, with q micro-batches held and the
    backward's transient bytes, and (m > 1) its second, with at least q - 1 held beside the
    gradients the first made."""
    first = static + q * held + trans
    if m < 2:
        return first
    return np.maximum(first, static + (q - 1) * held + grads + trans)


def _times(a: int, x: np.ndarray) -> np.ndarray:
    """a x, ``inf`` where x is (a disallowed stage, also at a = 0)."""
    return np.where(np.isfinite(x), a * np.where(np.isfinite(x), x, 0.0), np.inf)


def _chain_a(t: list[np.ndarray], u0: np.ndarray, m: int) -> float:
    """L_A - c: the backward programme H of the module docstring, then stage 0's end."""
    k = len(t)
    last = t[-1][:, -1]
    if k == 1:
        return float(u0[-1] + m * last[0])
    h = m * last  # H_{k-1}(a): the last stage from start a to the end
    for j in range(k - 2, 0, -1):
        tj = t[j]
        h = np.maximum(m * tj, tj + h[None, :]).min(axis=1)
    t0 = t[0][0]
    best = u0 + np.maximum(m * t0, t0 + h)
    best = best[np.isfinite(best)]
    return float(best.min()) if len(best) else np.inf


def _least_sum(cost: list[np.ndarray]) -> float:
    """min over partitions of sum_j cost[j][a_j, a_{j+1}]."""
    best = np.full(cost[0].shape[0], np.inf)
    best[0] = 0.0
    for j, cj in enumerate(cost):
        best = (best[:, None] + cj).min(axis=0)
        if j < len(cost) - 1:
            best[-1] = np.inf
    return float(best[-1])


def least_sum_plus_max(cost: list[np.ndarray], own: list[np.ndarray], levels: int) -> float:
    """A lower bound on min over partitions of sum_j cost_j + max_j own_j (matrices over the
    allowed starts, as :func:`one_chunk_bound` builds them), nearer it than the two minimised
    apart: with thresholds G_0 < ... < G_K among own's values (G_0 the least max, G_K the
    largest; at most ``levels`` + 1 of them), a partition whose max M is G_0
    costs at least G_0 + S(G_0), and one with M in (G_{i-1}, G_i] at least G_{i-1} + S(G_i),
    S(G) the least sum over the partitions whose own stays within G."""
    lo = _least_max(own)
    if not np.isfinite(lo):
        return np.inf
    values = np.unique(np.concatenate([o[np.isfinite(o)] for o in own]))
    values = values[values >= lo]
    if len(values) > levels + 1:
        values = np.unique(values[np.linspace(0, len(values) - 1, levels + 1).round().astype(int)])

    def least(g: float) -> float:
        return _least_sum([np.where(o <= g, c, np.inf) for c, o in zip(cost, own, strict=True)])

    best = float(values[0]) + least(float(values[0]))
    for below, at in itertools.pairwise(values):
        best = min(best, float(below) + least(float(at)))
    return best


def _least_max(cost: list[np.ndarray]) -> float:
    """min over partitions of max_j cost[j][a_j, a_{j+1}]."""
    best = np.full(cost[0].shape[0], np.inf)
    best[0] = -np.inf
    for j, cj in enumerate(cost):
        best = np.maximum(best[:, None], cj).min(axis=0)
        if j < len(cost) - 1:
            best[-1] = np.inf
    return float(best[-1])
