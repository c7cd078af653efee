"""A Lagrangian critical-path bound for every schedule family, minimised over every partition.

Any family runs chunk s (of S = p v) on rank ``owner[s]``
(:func:`pipeplan.planner.families.rank_of_stage`); rank j's lowest chunk is
first_j = min{s : owner[s] = j}, its highest top_j.  In the replay (:mod:`pipeplan.planner.replay`)
every action runs after its inputs, a rank's actions one at a time, so for every partition and
recomputation these chains bound the step T (c the step's overhead before the first action):

    (A)  T >= c + sum_{s < first_j} F'_s + m sum_{owner[s] = j} (F'_s + K_s) + U_j
    (A') T >= c + sum_{s < first_j} (F'_s + B'_s) + m sum_{owner[s] = j} (F'_s + K_s) + U_0
    (C)  T >= c + sum_s F'_s + sum_{s > top_j} D_s
             + sum_{owner[s] = j} (m K_s + a_js F'_s) + [sum_{s < first_j} B'_s + U_0, or U_j]

per chunk s over its units (the costs of :mod:`pipeplan.solvers.chunks`, C_s the round trip
across the cut after it, paid where chunk s + 1 sits on another rank):

    F'_s = F_s + [cross_s] C_s / 2       a forward and the blocking send of its output
    B'_s = [cross_s] C_s / 2 + B_s       a receive and the full backward
    D_s  = [cross_s] C_s / 2 + (I_s where the family splits the backward, else B_s)
    K_s  = [cross_s] C_s / 2 + a micro-batch's backward work on the rank: B_s, or I_s + W_s
           where the backward is split (the least of the two in DualPipeV, whose order also
           runs B; B_0 on chunk 0, whose I torch skips; a recomputing chunk's fused B_s)
    W_s, U_s  its weight gradient (on the longest paths below) and its update

and a_js the forwards of chunk s that torch's order for rank j
(:func:`pipeplan.planner.families.action_order`) runs after its first backward.  (A') and the
first form of (C)'s tail hold only for families without a split backward.

Proof.  (A): rank j's first action is a forward F(s, i), s >= first_j, which needs the forwards
of micro-batch i through chunks 0..s-1 one after another; from then on rank j runs each of its
m micro-batches through each of its chunks (forward, send, receive, backward work), one action
at a time, and it updates its chunks after its last action.  (A'): without a split backward,
rank j's last action is some B(s, i), s >= first_j, after which B(s - 1, i) .. B(0, i) run one
after another, the last on rank 0, which updates after it.  (C): rank j's first backward is on
its highest chunk, B (or I) (top_j, i) for some i, which needs micro-batch i's forwards through
every chunk and its backwards down from the last chunk; from its start rank j runs every one of
its backwards and the a_js forwards its order puts after it, one at a time; then the tail as in
(A') or (A).  Contention, tied all-reduces and the other ranks' updates only lengthen the step.
Recomputation: each chunk takes its keeping or its recomputing costs in every term, whichever
the plan chose; the bound below lets each chunk choose the least for the weighted sum, so it
holds for every choice.  Memory: a chunk whose parameters with their optimizer states, its m
input and output buffers and the q_s micro-batches its rank's order holds at once cannot fit
its device cannot be in a plan that fits (the rank's peak is at least that); such a chunk is
left out, and one that can fit only recomputing recomputes.

Longest paths.  With the family, v and m fixed, torch's order is a fixed graph of actions (a
rank's order, a micro-batch's data); only the durations depend on the cuts.  So the longest
path of any partition (:func:`path_row`), read as counts of each chunk's terms, is a chain of
every partition; the ascent below adds the longest path of each partition it visits.

Each chain is a sum over chunks of coefficients times the terms F', B', D, K, U, W of the
chunk's span (:func:`chain_coefficients`).  Their maximum is not separable over chunks, but
every weighted mean is: for weights lambda >= 0 summing to 1,

    g(lambda) = c + min over partitions of sum_s cost_s^lambda(l_s, r_s)
             <= min over partitions of max_k chain_k

is one dynamic programme over the allowed cuts (O(S a^2), a the allowed starts), and
:func:`chain_bound` is the largest g found by Kelley's cutting planes on lambda: a GLOP LP
picks the weights that make the least weighted sum over the partitions seen largest, and its
optimum says when no weights can do better.  The mean over ranks of (A) is the work bound
with a ramp; one rank's (C) is what shows a heavy end chunk
delaying every rank; between them the ascent finds the bubble of a loop.  Weighted means cannot
see that whole units do not divide evenly among ranks; :mod:`pipeplan.solvers.chain_model`
solves the same chains as an integer programme for that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from ortools.linear_solver import pywraplp

from pipeplan.planner.collectives import state_factors
from pipeplan.planner.families import FAMILIES, action_order, rank_of_stage
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import UnitCosts, unit_costs
from pipeplan.planner.updates import update_cost
from pipeplan.solvers.chunks import fixed_flags
from pipeplan.solvers.path_bound import cut_transfers
from pipeplan.solvers.schedule_search import Cuts

__all__ = [
    "ITERATIONS",
    "TERMS",
    "Chains",
    "chain_bound",
    "chain_coefficients",
    "modes_of",
    "path_row",
    "runs_fused_backward",
    "unshared_params",
]

#: Multiplicative-weights steps of :func:`chain_bound` (each one dynamic programme).
ITERATIONS = 60

#: The per-chunk terms a chain weighs, in the order of :func:`chain_coefficients`' last axis.
TERMS = ("F'", "B'", "D", "K", "U", "W")


class Chains(NamedTuple):
    """:func:`chain_bound`'s answer: the bound, the chains it weighed (rows K[s, term]) and the
    work it did (span-term products of its dynamic programmes, :func:`chain_bound`)."""

    bound: float
    rows: np.ndarray
    work: float


@lru_cache(maxsize=256)
def chain_coefficients(family: str, p: int, v: int, m: int) -> np.ndarray:
    """K[k, s, t]: how many times chain k (module docstring: (A), (A') and (C) of each rank,
    duplicates dropped) counts term t (:data:`TERMS`) of chunk s.  Read-only."""
    owner = rank_of_stage(family, p, v)
    k = len(owner)
    split = FAMILIES[family].split_backward
    order = action_order(family, p, v, m)
    f, b, d, kk, u, _ = range(len(TERMS))
    rows: list[np.ndarray] = []
    for j in range(p):
        mine = [s for s in range(k) if owner[s] == j]
        first = mine[0]
        tails = [np.zeros((k, len(TERMS)))]
        tails[0][mine, u] = 1
        if not split:
            drain = np.zeros((k, len(TERMS)))
            drain[:first, b] = 1
            drain[[s for s in range(k) if owner[s] == 0], u] += 1
            tails.append(drain)
        acts = order[j]
        turn = next((i for i, x in enumerate(acts) if x.kind != "F"), len(acts))
        rest = np.zeros((k, len(TERMS)))  # rank j's actions from X on
        for i in range(len(acts) - 1, -1, -1):
            x = acts[i]
            if x.kind == "F":
                rest[x.stage, f] += 1
            elif x.kind in ("B", "I"):
                rest[x.stage, kk] += 1
            if i not in (0, turn):  # X: its first action (A, A') and first backward (C)
                continue
            head = np.zeros((k, len(TERMS)))
            if x.kind == "F":
                head[: x.stage, f] = 1
            else:
                head[:, f] = 1
                head[x.stage + 1 :, d] = 1
            rows.extend(head + rest + tail for tail in tails)
    out = np.unique(np.stack(rows), axis=0)
    out.setflags(write=False)
    return out


def chain_bound(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    family: str,
    v: int,
    m: int,
    *,
    target: float = math.inf,
    iterations: int = ITERATIONS,
    work: float = math.inf,
    plans: Sequence[tuple[Sequence[int], Sequence[bool]]] = (),
) -> Chains:
    """The largest g(lambda) found (module docstring): a lower bound on the replayed step of
    every partition and recomputation of ``family`` with v chunks per rank and m micro-batches
    that fits; 0 where no partition keeps to the allowed cuts.  The chains: those of
    :func:`chain_coefficients`, the longest paths (:func:`path_row`) of ``plans`` (chunk starts
    and recompute flags, such as a search's best), and of each partition the ascent visits.
    Stops early once it reaches ``target`` (the step of a plan in hand: nothing to prove),
    after ``iterations`` dynamic programmes, or before one would take the work past ``work``
    (each costs the sum over chunks of modes x terms x spans: a count, not a clock)."""
    p = cluster.n_stages
    modes = modes_of(profile, cluster, options, family, v, m)
    rows = list(chain_coefficients(family, p, v, m))
    pos = {int(b): a for a, b in enumerate(Cuts.of(options, profile.n_units).positions)}
    for starts, rc in plans:
        ends = [*starts[1:], profile.n_units]
        at = [(pos.get(int(a)), pos.get(int(b))) for a, b in zip(starts, ends, strict=True)]
        if len(at) == len(modes) and all(a is not None and b is not None for a, b in at):
            values = np.array([
                modes[s][-1 if rc[s] else 0][:, a, b] for s, (a, b) in enumerate(at)
            ])  # fmt: skip
            if np.isfinite(values).all():
                rows.append(path_row(family, p, v, m, values))
    coef = np.unique(np.stack(rows), axis=0)
    tables = _tables(modes)
    cost = float(sum(clean.size for clean, _ in tables))
    lam = np.full(coef.shape[0], 1.0 / coef.shape[0])
    c = cluster.step_overhead_s
    best = done = 0.0
    master: _Master | None = None
    for _ in range(max(iterations, 1)):
        if done + cost > work and done > 0:
            break
        done += cost
        value, values = _least(tables, modes, np.einsum("k,kst->st", lam, coef))
        if not np.isfinite(value):
            return Chains(0.0, coef, done)
        best = max(best, value + c)
        if best >= target:
            break
        if master is None:
            master = _Master(max(value, 1e-30))
            for chain in coef:
                master.chain(chain)
        row = path_row(family, p, v, m, values)
        new = not (coef == row).all(axis=(1, 2)).any()  # a longer path of this partition
        if new:
            coef = np.concatenate([coef, row[None]])
            master.chain(row)
        master.partition(coef, values)
        lam, ceiling = master.solve()
        if not new and ceiling + c <= best * (1 + 1e-9):  # no weights do better: done
            break
    return Chains(best, coef, done)


class _Master:
    """Kelley's cutting planes on g: the weights lambda that maximise min over the partitions
    seen of sum_k lambda_k chain_k(P), an LP (GLOP) kept across iterations: a new chain adds a
    column, a new partition a row.  Its optimum bounds every weights' g while the chains stay
    these."""

    def __init__(self, scale: float) -> None:
        self.lp = pywraplp.Solver.CreateSolver("GLOP")
        self.scale = scale
        self.eta = self.lp.NumVar(-self.lp.infinity(), self.lp.infinity(), "eta")
        self.simplex = self.lp.Constraint(1.0, 1.0)
        self.lam: list[pywraplp.Variable] = []
        self.cuts: list[tuple[pywraplp.Constraint, np.ndarray]] = []
        objective = self.lp.Objective()
        objective.SetCoefficient(self.eta, 1.0)
        objective.SetMaximization()

    def chain(self, row: np.ndarray) -> None:
        var = self.lp.NumVar(0.0, 1.0, f"l{len(self.lam)}")
        self.lam.append(var)
        self.simplex.SetCoefficient(var, 1.0)
        for cut, values in self.cuts:
            cut.SetCoefficient(var, -float((row * values).sum()) / self.scale)

    def partition(self, coef: np.ndarray, values: np.ndarray) -> None:
        cut = self.lp.Constraint(-self.lp.infinity(), 0.0)  # eta - sum lambda_k L_k(P) <= 0
        cut.SetCoefficient(self.eta, 1.0)
        for var, length in zip(self.lam, np.einsum("kst,st->k", coef, values), strict=True):
            cut.SetCoefficient(var, -float(length) / self.scale)
        self.cuts.append((cut, values))

    def solve(self) -> tuple[np.ndarray, float]:
        if self.lp.Solve() != pywraplp.Solver.OPTIMAL:  # pragma: no cover - bounded, feasible
            raise RuntimeError("the chains' master LP did not solve")
        weights = np.maximum(np.array([x.solution_value() for x in self.lam]), 0.0)
        return weights / weights.sum(), self.eta.solution_value() * self.scale


def path_row(family: str, p: int, v: int, m: int, values: np.ndarray) -> np.ndarray:
    """The chain of the longest path through torch's order for one partition (its terms
    ``values`` [s, term], from :func:`modes_of`): a row of coefficients like
    :func:`chain_coefficients`' that holds for every partition, since the path's actions and
    edges (a rank's order, a micro-batch's data) are the family's, not the partition's.

    Durations: F(s) F'_s; B(s) B'_s; I(s) D_s (at most I'_s; chunk 0's only receives); W(s)
    W_s.  Each action starts when its rank's previous one and its input end; the path
    walks back from the rank whose last action plus its update ends last, through the
    predecessor that set each start.  Contention and tied all-reduces left out, as in every
    chain."""
    k = p * v
    u = TERMS.index("U")
    acts, finals = _walk(family, p, v, m)
    owner = rank_of_stage(family, p, v)
    ends = [0.0] * len(acts)
    pred = [-1] * len(acts)
    for n, (s, t, before, d1, d2) in enumerate(acts):
        start, why = (ends[before], before) if before >= 0 else (0.0, -1)
        if d1 >= 0 and ends[d1] > start:
            start, why = ends[d1], d1
        if d2 >= 0 and ends[d2] > start:
            start, why = ends[d2], d2
        ends[n], pred[n] = start + float(values[s, t]), why
    updates = [float(sum(values[s, u] for s in range(k) if owner[s] == r)) for r in range(p)]
    r = max(range(p), key=lambda q: (ends[finals[q]] if finals[q] >= 0 else 0.0) + updates[q])
    row = np.zeros((k, len(TERMS)))
    row[[s for s in range(k) if owner[s] == r], u] = 1
    n = finals[r]
    while n >= 0:
        s, t = acts[n][0], acts[n][1]
        row[s, t] += 1
        n = pred[n]
    return row


@lru_cache(maxsize=256)
def runs_fused_backward(family: str, p: int, v: int, m: int) -> bool:
    """Whether torch's order for the family runs any full backward B (DualPipeV does beside
    its I and W; ZB-V and zb-interleaved run I and W only, B only as a recomputing chunk's)."""
    return any(x.kind == "B" for acts in action_order(family, p, v, m) for x in acts)


@lru_cache(maxsize=256)
def _in_flight(family: str, p: int, v: int, m: int) -> tuple[int, ...]:
    """q_s: the most micro-batches of chunk s that its rank's order holds at once, each from
    its forward until its backward (B, or I where the backward is split)."""
    k = p * v
    most = [0] * k
    for acts in action_order(family, p, v, m):
        now = [0] * k
        for x in acts:
            if x.kind == "F":
                now[x.stage] += 1
                most[x.stage] = max(most[x.stage], now[x.stage])
            elif x.kind in ("B", "I"):
                now[x.stage] -= 1
    return tuple(most)


@lru_cache(maxsize=64)
def _walk(
    family: str, p: int, v: int, m: int
) -> tuple[tuple[tuple[int, int, int, int, int], ...], tuple[int, ...]]:
    """torch's actions in an order that runs each after its inputs: (chunk, term, the rank's
    previous action, input, input) by index (-1: none); and each rank's last action."""
    order = action_order(family, p, v, m)
    k = p * v
    term = {"F": TERMS.index("F'"), "B": TERMS.index("B'"), "I": TERMS.index("D"),
            "W": TERMS.index("W")}  # fmt: skip
    index: dict[tuple[str, int, int], int] = {}
    out: list[tuple[int, int, int, int, int]] = []
    pos = [0] * p
    last = [-1] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(order[r]):
                x = order[r][pos[r]]
                s, i = x.stage, x.microbatch
                if x.kind == "F":
                    need = [("F", s - 1, i)] if s > 0 else []
                elif x.kind == "W":
                    need = [("I", s, i)]
                else:
                    need = [("F", s, i)]
                    if s < k - 1:
                        need.append(
                            ("B", s + 1, i) if ("B", s + 1, i) in index else ("I", s + 1, i)
                        )
                if any(n not in index for n in need):
                    break
                deps = [index[n] for n in need] + [-1, -1]
                index[(x.kind, s, i)] = len(out)
                out.append((s, term[x.kind], last[r], deps[0], deps[1]))
                last[r] = len(out) - 1
                pos[r] += 1
                progress = True
    if any(pos[r] < len(order[r]) for r in range(p)):  # pragma: no cover - torch's are valid
        raise RuntimeError(f"{family}'s action lists deadlock")
    return tuple(out), tuple(last)


def unshared_params(c: UnitCosts) -> np.ndarray:
    """Each unit's parameter bytes without the shared parameters it owns (a chunk holding a
    shared parameter may count it on another chunk of its rank): at most what any chunk
    charges for its units."""
    plain = np.asarray(c.w, dtype=np.float64).copy()
    for nbytes, users in c.shared:
        plain[int(users[0])] = max(plain[int(users[0])] - nbytes, 0.0)
    return plain


def modes_of(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    family: str,
    v: int,
    m: int,
    *,
    memory: bool = True,
) -> list[list[np.ndarray]]:
    """Per chunk, its keeping and recomputing modes: each an array [term, a, b] of the terms
    over every allowed span (chunks.py's costs, vectorised; ``inf`` where the span is not
    allowed or, with ``memory``, cannot fit; the checkpoint policy leaves modes out).

    Memory: a chunk's parameters with their optimizer states and its m input and output
    buffers are always held, and at some point of its rank's order q_s of its micro-batches
    are held at once, each from its forward to its backward (or I) (:func:`_in_flight`); the
    rank's peak is at least their sum, so a span whose sum exceeds the device cannot fit."""
    owner = rank_of_stage(family, cluster.n_stages, v)
    split = FAMILIES[family].split_backward
    c = unit_costs(profile, m)
    n, k = c.n, len(owner)
    cuts = Cuts.of(options, n)
    pos = np.asarray(cuts.positions)
    size = pos[None, :] - pos[:, None]
    ok = (size >= max(cuts.min_units, 1)) & (size <= (cuts.max_units or n))

    def span(values: np.ndarray) -> np.ndarray:
        at = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])[pos]
        return at[None, :] - at[:, None]

    def prefix_span(prefix: np.ndarray) -> np.ndarray:
        at = np.asarray(prefix, dtype=np.float64)[pos]
        return at[None, :] - at[:, None]

    keep_f, keep_b = prefix_span(c.Pf), prefix_span(c.Pg)
    remake_f, remake_b = prefix_span(c.Pfc) + c.call_f, prefix_span(c.Pr) + c.call_b
    keep_i = keep_w = np.zeros_like(keep_f)
    if split:
        ts = [u.timings[profile.batch_size // m] for u in profile.units]
        keep_i = span(np.array([t.backward_input_s or 0.0 for t in ts]))
        keep_w = span(np.array([t.backward_weight_s or 0.0 for t in ts]))
    params = span(unshared_params(c))
    acts = prefix_span(c.Pa)
    x = np.asarray(c.x, dtype=np.float64)[pos]
    half = cut_transfers(c, cluster, pos)[None, :]
    state = state_factors(options.optimizer, cluster)
    static = params * (state.params + state.optimizer) + m * (x[:, None] + x[None, :])
    upd = update_cost(profile, options.optimizer, cluster)
    update = np.zeros_like(params)
    if all(sl >= 0 for sl, _ in upd.pieces):  # U never falls as w grows
        uniq, inverse = np.unique(params, return_inverse=True)
        update = np.array([upd.seconds(float(w)) for w in uniq])[inverse].reshape(params.shape)
    flags = fixed_flags(options, k)
    o = cluster.engine_overhead_s

    alive = _in_flight(family, cluster.n_stages, v, m)
    fused = runs_fused_backward(family, cluster.n_stages, v, m)

    def _mode(first: bool, last: bool, cross: bool, sp: float, memory_bytes: int, rc: bool,
              q: int) -> np.ndarray:  # fmt: skip
        h = half if cross else 0.0
        cap = memory_bytes + 2.0  # chunks.py's int() rounding
        ends = float(c.out + c.loss_a) if last else 0.0
        lf, lg = (c.loss_f, c.loss_g) if last else (0.0, 0.0)
        held = x[None, :] + ends + (0.0 if rc else acts)
        fits = ok & (static + q * held <= cap + 2 * q) if memory else ok  # each int()ed
        f = ((remake_f if rc else keep_f) + lf) / sp + o
        b = ((remake_b if rc else keep_b) + lg) / sp + o
        desc = work = b
        weight = np.zeros_like(b)
        if split and first:  # chunk 0's I only receives (torch's no-op), its W is the whole B
            desc, weight = np.zeros_like(b), b
        elif split and not rc:  # I and W; a fused B only where torch's order runs one
            i, weight = (keep_i + lg) / sp + o, keep_w / sp + o
            desc, work = (np.minimum(b, i), np.minimum(b, i + weight)) if fused else (i, i + weight)
        terms = np.stack([f + h, h + b, h + desc, h + work, update / sp, weight])
        return np.where(fits[None], terms, np.inf)

    out: list[list[np.ndarray]] = []
    built: dict[tuple[object, ...], list[np.ndarray]] = {}  # chunks alike share their arrays
    for s in range(k):
        last = s == k - 1
        cross = not last and owner[s] != owner[s + 1]
        device = cluster.devices[owner[s]]
        allowed = (False, True) if flags is None else (flags[s],)
        key = (last, cross, split and s == 0, device.speed, device.memory_bytes, allowed, alive[s])
        if key not in built:
            built[key] = [
                _mode(s == 0, last, cross, device.speed, device.memory_bytes, rc, alive[s])
                for rc in allowed
            ]
        out.append(built[key])
    return out


def _least(
    tables: list[tuple[np.ndarray, np.ndarray]], modes: list[list[np.ndarray]], weights: np.ndarray
) -> tuple[float, np.ndarray]:
    """g(lambda) - c for the per-chunk term ``weights`` [s, term], and the terms [s, term] of a
    partition that attains it (each chunk in its least mode); ``tables``: :func:`_tables`."""
    k = len(modes)
    size = modes[0][0].shape[1]
    best = np.full(size, np.inf)
    best[0] = 0.0
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for s in range(k):
        clean, mask = tables[s]
        costs = np.tensordot(np.maximum(weights[s], 0.0), clean, axes=([0], [1])) + mask
        which = np.argmin(costs, axis=0)
        cost = np.take_along_axis(costs, which[None], axis=0)[0]
        total = best[:, None] + cost
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(size)]
        if s < k - 1:
            best[-1] = np.inf
        back.append((arg, which))
    value = float(best[-1])
    values = np.zeros((k, len(TERMS)))
    if not np.isfinite(value):
        return value, values
    b = size - 1
    for s in range(k - 1, -1, -1):
        arg, which = back[s]
        a = int(arg[b])
        values[s] = modes[s][int(which[a, b])][:, a, b]
        b = a
    return value, values


def _tables(modes: list[list[np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk: its modes' terms with ``inf`` as 0 [mode, term, a, b], and ``inf`` where a
    mode cannot run [mode, a, b] (chunks alike share them)."""
    memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out = []
    for ms in modes:
        if id(ms) not in memo:
            stack = np.stack(ms)
            ok = np.isfinite(stack[:, 0])
            memo[id(ms)] = (np.where(np.isfinite(stack), stack, 0.0), np.where(ok, 0.0, np.inf))
        out.append(memo[id(ms)])
    return out
