"""The CP-SAT model of one micro-batch count: its variables, constraints and objective.

:func:`pipeplan.solvers.cpsat.partition_cpsat` builds one :class:`CpsatModel` per micro-batch count m and
solves it.  Integer *boundary* variables

    0 = b_0 < b_1 < ... < b_{p-1} < b_p = n,      stage j = units b_j .. b_{j+1} - 1,

with ``min_units <= b_{j+1} - b_j <= max_units`` and, for a unit u pinned to stage j,
``b_j <= u < b_{j+1}``; with ``allowed_cuts`` (where a target framework can cut) each inner
``b_j`` lies in that set.  Every per-stage quantity of :mod:`pipeplan.planner.costmodel` is a difference of
prefix sums, read from constant tables with element constraints on the boundaries:

    t_j = Q_j[b_{j+1}] - Q_j[b_j] + C[b_{j+1}] + o_j    (C only for j < p - 1)
    Q_j[k] = sum_{u<k} (f_u + (r_u if rc_j else g_u)) / s_j   (speed s_j; r_u: checkpointed
                                                               backward, recompute rc_j)
    o_j = what stage_time adds per stage (the engine's fixed cost per operation)
    M_j = (2 + k) (W[b_{j+1}] - W[b_j] + H_j) + q_j X[b_j] + A[b_{j+1}] - A[b_j]  (recompute)
        | (2 + k) (W[b_{j+1}] - W[b_j] + H_j) + q_j (A[b_{j+1}] - A[b_j])           (no recompute)
    H_j = sum over shared parameters of bytes * (h_j - [stage j holds the owner]),
          h_j >= [stage j holds user u] = [b_j <= u] - [b_{j+1} <= u] for every user u
    M_j <= cap_j
    c_j = Q_j[b_{j+1}] - Q_j[b_j] + o_j                   (the stage's compute)
    a_j = t_j + (m - 1) k c_j,   s_j = t_j - k c_j          (contention k; see costmodel)
    U_j >= (slope_k / s_j) (W[b_{j+1}] - W[b_j] + H_j) + intercept_k / s_j   for every affine
          piece k of the update's cost U(w) (pipeplan.planner.updates; one prefix table per piece)
    D_j = sum_{i<j} (B_i[b_{i+1}] - B_i[b_i] + ob_i + C[b_{i+1}] / 2)   (B_i: backward prefix table)
    minimise  sum_j a_j + (m - 1) T + R,   T >= s_j,  R >= U_j - D_j  for all j,
              R >= A + U_j - D_s  for stages j holding a copy of a shared parameter that spans
              stages, s the stage of its owner (its all-reduce, A ticks, waits for s; big-M
              on booleans for "j holds it", "it spans" and "s owns it"; see _tied_tail)
              R >= max(U_0 + k (U_j - D_j), U_j - D_j + k U_0) for j > 0 when no parameter is
              shared, k = min(kappa_u, 1) (updates that overlap slow each other; a bound that
              is exact for p = 2 and a relaxation beyond; see _contended_tail)
    (with k = 0, or m = 1, a_j = s_j = t_j; R = U_0 when p = 1).

o_j, C and the stage's F and B are read from :func:`pipeplan.planner.costmodel.stage_time`, so the model
follows the cost model.  Bytes are exact; times are integer ticks, each table entry rounded to the
nearest one (:mod:`pipeplan.solvers.cpsat_scale` bounds the error this makes).

Size.  p - 1 integer variables with at most n values each and O(p) element and linear
constraints (O(p w) literals once CP-SAT encodes the elements, w the width of the boundary window
that :mod:`pipeplan.solvers.bounds` derives from an incumbent).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from ortools.sat.python import cp_model

from pipeplan.planner.costmodel import contention, in_flight, recomputes
from pipeplan.planner.types import Cluster
from pipeplan.planner.unitcosts import UnitCosts
from pipeplan.planner.updates import UpdateCost
from pipeplan.solvers.bounds import stage_backward, stage_compute, stage_offsets
from pipeplan.solvers.cpsat_scale import cut_times, to_ticks
from pipeplan.solvers.request import ResolvedRequest

#: Distinct parameter sizes the largest-parameter charge tells apart (:meth:`CpsatModel._largest_param`).
_SIZE_LEVELS = 32

__all__ = ["CpsatModel"]

_KAPPA_SCALE = 1000
"""K: the update contention kappa_u enters the model as floor(K kappa_u) / K."""
_WORKERS = 2
_SEED = 0


class CpsatModel:
    """The CP-SAT model of one micro-batch count (the formulation of the module docstring).

    ``b`` holds the boundary variables and ``objective`` the step time in ticks; :meth:`solve`
    runs CP-SAT on the model and :meth:`starts` reads the partition back.
    """

    def __init__(
        self,
        costs: UnitCosts,
        request: ResolvedRequest,
        cluster: Cluster,
        scale: float,
        caps: list[int],
        window: tuple[list[int], list[int]] | None = None,
        hint: tuple[int, ...] | None = None,
        t_floor: int = 0,
    ) -> None:
        """The model of ``request`` at ``costs.m`` on ``cluster`` (the request's, or it without
        memory limits) with memory ``caps``."""
        options = request.options
        n, p, m = costs.n, cluster.n_stages, costs.m
        self.n, self.p, self.m = n, p, m
        md = cp_model.CpModel()
        self.model = md
        self._le: dict[tuple[int, int], cp_model.IntVar] = {}
        lo_u, hi_u = options.min_units, options.max_units or n
        # Boundary b_j: stage j starts at unit b_j.  Domains from the unit counts, the pins and
        # the window an incumbent leaves (see Bounds.window).
        lower = [max(j * lo_u, n - (p - j) * hi_u) for j in range(p + 1)]
        upper = [min(n - (p - j) * lo_u, j * hi_u) for j in range(p + 1)]
        if window is not None:
            lower = [max(a, b) for a, b in zip(lower, window[0])]
            upper = [min(a, b) for a, b in zip(upper, window[1])]
        for unit, stage in options.pinned.items():
            for j in range(stage + 1):
                upper[j] = min(upper[j], unit)
            for j in range(stage + 1, p + 1):
                lower[j] = max(lower[j], unit + 1)
        if any(lo > hi for lo, hi in zip(lower, upper)):
            md.add_bool_or([])  # the pins and unit counts contradict each other
        self.b = [md.new_int_var(lower[j], max(lower[j], upper[j]), f"b{j}") for j in range(p + 1)]
        if options.allowed_cuts is not None:  # where a target framework can cut
            cuts = cp_model.Domain.from_values(list(options.allowed_cuts))
            for j in range(1, p):
                md.add_linear_expression_in_domain(self.b[j], cuts)
        md.add(self.b[0] == 0)
        md.add(self.b[p] == n)
        for j in range(p):
            md.add(self.b[j + 1] - self.b[j] >= lo_u)
            if options.max_units is not None:
                md.add(self.b[j + 1] - self.b[j] <= hi_u)
        cache: dict[tuple[int, tuple[int, ...]], cp_model.IntVar | int] = {}

        def at(j: int, table: list[int], name: str) -> cp_model.IntVar | int:
            """table[b_j], one element constraint per (boundary, table)."""
            if j in (0, p):
                return table[0 if j == 0 else n]
            key = (j, tuple(table))
            if key not in cache:
                var = md.new_int_var(min(table), max(table), f"{name}{j}")
                md.add_element(self.b[j], table, var)
                cache[key] = var
            return cache[key]

        # Tables: times in ticks, bytes exact.
        cuts = np.asarray(cut_times(costs, cluster, options))
        comm = to_ticks(cuts, scale)
        W = [int(v) for v in costs.Pw]
        update = request.update
        self._Pw = costs.Pw
        all_bytes = float(costs.Pw[-1]) + sum(float(nb) for nb, _ in costs.shared)
        slowest = min(dev.speed for dev in cluster.devices)
        self._u_top = to_ticks([update.seconds(all_bytes) / slowest * scale], 1.0)[0] + 2
        self._u_top += len(update.pieces) + len(costs.shared)
        A = [int(v) for v in costs.Pa]
        biggest = [int(v) for v in costs.largest_param(np.arange(n), np.arange(n))]
        X = [int(v) for v in costs.x]
        # Training state per parameter byte, times D (d where FSDP shards it over d ranks,
        # else 1) so that every memory term is an integer: D M_j <= D cap_j.
        state = request.state
        D = cluster.data_parallel if cluster.data_parallel_mode == "shard" else 1
        k_static, k_grad = round(D * (state.params + state.optimizer)), round(D * state.grads)
        # (shared parameter index, all-reduce ticks) of every shared parameter: its holders
        # wait for the first holder before they update, even when the all-reduce is free.
        syncs = (
            [
                (k, to_ticks([cluster.allreduce_s(float(nbytes))], scale)[0])
                for k, (nbytes, _) in enumerate(costs.shared)
            ]
            if p > 1
            else []
        )
        self._holds: dict[tuple[int, int], cp_model.IntVar] = {}
        self._users: dict[int, np.ndarray] = {}
        auto = options.checkpoint == "auto"
        # Under auto a boolean per stage says whether it recomputes; each variant's time and
        # memory constraints hold only where its literal does (keeping wins where it fits:
        # it is never slower, pipeplan.planner.costmodel.stage_recomputes).
        offsets_by = {rc: stage_offsets(costs, cluster, options, rc) for rc in (False, True)}
        kappa = contention(cluster, m)
        ka = (m - 1) * kappa
        horizon, floor = 0, 0
        self.a: list[cp_model.IntVar] = []
        self.s: list[cp_model.IntVar] = []
        self.recompute: list[cp_model.IntVar | bool] = []
        tails: list[tuple[cp_model.LinearExpr | int, cp_model.LinearExpr | int]] = []  # U_j, D_j
        drain: cp_model.LinearExpr | int = 0  # D_j = sum_{i<j} (B_i + C_i / 2)
        half = to_ticks(cuts / 2, scale)  # the gradient's trip, for the drain D_j

        def only_if(constraint: cp_model.Constraint, lit: Any) -> None:
            if lit is not None:
                constraint.only_enforce_if(lit)

        for j in range(p):
            variants: list[tuple[bool, Any]]
            if auto:
                z = md.new_bool_var(f"rc{j}")
                variants = [(False, z.Not()), (True, z)]
                self.recompute.append(z)
            else:
                rc_fixed = recomputes(options.checkpoint, j, p)
                variants = [(rc_fixed, None)]
                self.recompute.append(rc_fixed)
            cut = at(j + 1, comm, "c") if j < p - 1 else 0
            # a_j (its term of the sum) and s_j (its steady-state slot term), from tables of
            # the compute scaled by 1 + (m - 1) k and by 1 - k.
            terms = []
            for name, factor in (("a", 1.0 + ka), ("s", 1.0 - kappa)):
                exprs = []
                lo, hi = 0, 0
                for rc, lit in variants:
                    Q = to_ticks(stage_compute(costs, cluster, options, j, rc) * factor, scale)
                    o = to_ticks([offsets_by[rc][j] * factor], scale)[0]
                    lo = min(lo, min(Q) - max(Q) + o)
                    hi = max(hi, max(Q) - min(Q) + max(0, o) + max(comm))
                    expr = at(j + 1, Q, name + "e") - at(j, Q, name + "s") + o + cut
                    exprs.append((expr, lit, rc))
                var = md.new_int_var(lo, hi, f"{name}{j}")
                for expr, lit, rc in exprs:
                    if factor > 0:
                        # The objective grows with the term, and recomputing never costs less
                        # than keeping: a lower bound per variant is exact at the optimum, and
                        # keeping's holds whatever the stage does (a tighter relaxation than
                        # one equality per literal).
                        only_if(md.add(var >= expr), lit if rc else None)
                    else:
                        only_if(md.add(var == expr), lit)
                terms.append(var)
                if name == "s":
                    horizon, floor = max(horizon, hi), min(floor, lo)
            self.a.append(terms[0])
            self.s.append(terms[1])
            q = in_flight(options.schedule, j, p, m)
            copies = self._copies(costs, j)
            held = sum((int(nbytes) * e for nbytes, e in copies), start=0)
            w_j = at(j + 1, W, "we") - at(j, W, "ws") + held
            if update or syncs:  # U_j and the drain D_j before it
                upd: cp_model.LinearExpr | int = 0
                if update:
                    upd = self._update(j, update, cluster, scale, copies, at)
                tails.append((upd, drain))
                backs = []
                for rc, lit in variants:
                    back, ob = stage_backward(costs, cluster, options, j, rc)
                    QB = to_ticks(back, scale)
                    expr = at(j + 1, QB, "be") - at(j, QB, "bs") + to_ticks([ob], scale)[0]
                    backs.append((expr, lit, max(QB) + abs(to_ticks([ob], scale)[0])))
                if len(backs) == 1:
                    drain = drain + backs[0][0]
                else:
                    top_b = max(b for _, _, b in backs)
                    bvar = md.new_int_var(-top_b, top_b, f"B{j}")
                    for expr, lit, _ in backs:
                        only_if(md.add(bvar == expr), lit)
                    drain = drain + bvar
                if j < p - 1:  # the gradient's trip across the cut after stage j
                    drain = drain + at(j + 1, half, "h")
            # M_j (pipeplan.planner.costmodel.memory_parts) <= cap_j, its max() as one constraint
            # per branch: the first backward, and a later one with the remade activations or
            # the largest parameter's gradient temporary.
            acts = at(j + 1, A, "ae") - at(j, A, "as")
            x_out = at(j + 1, X, "xo") if j < p - 1 else 0
            last = j == p - 1
            rest = m * at(j, X, "x") + m * x_out + (j > 0) * at(j, X, "x")
            base = k_static * w_j + D * (rest + (int(2 * costs.out) if last else 0))
            later = q if options.schedule == "1f1b" and m > q else q - 1
            temp = self._largest_param(j, biggest, at) if m > 1 else None
            for rc, lit in variants:
                per_mb = (
                    x_out + (0 if rc else acts) + (int(costs.loss_a + costs.out) if last else 0)
                )
                remade = acts if rc else 0
                peaks = [
                    base + D * (q * per_mb + remade),
                    base + k_grad * w_j + D * (later * per_mb + remade),
                ]
                if temp is not None:
                    peaks.append(base + k_grad * w_j + D * (later * per_mb + temp))
                for peak in peaks:
                    only_if(md.add(peak <= D * caps[j]), lit)
                if auto and not rc:  # a stage recomputes only where keeping would not fit
                    over = [md.new_bool_var(f"over{j}_{k}") for k in range(len(peaks))]
                    for flag, peak in zip(over, peaks):
                        md.add(peak >= D * caps[j] + 1).only_enforce_if(flag)
                    md.add_bool_or([lit, *over])  # keep (lit), or keeping is over some limit
        # max_j t_j >= t_floor, and s_j >= (1 - k) t_j when k <= 1 (c_j <= t_j).
        lo_t = floor
        if kappa <= 1:
            lo_t = max(floor, min(math.floor(t_floor * (1 - kappa)) - 1, horizon))
        self.tmax = md.new_int_var(lo_t, horizon, "T")
        md.add_max_equality(self.tmax, self.s)
        # The engine's fixed cost per step: a constant, kept so that ticks track step times.
        step_cost = to_ticks([cluster.step_overhead_s], scale)[0]
        self.objective = sum(self.a) + (m - 1) * self.tmax + step_cost
        if tails:  # R >= U_j - D_j for every stage (R >= U_0 >= 0)
            top = self._u_top
            top += sum(a for _, a in syncs)
            self.tail = md.new_int_var(0, top, "R")
            for upd_j, before in tails:
                md.add(self.tail >= upd_j - before)
            if not syncs:  # with tied gradients the model stays a relaxation (see partition_cpsat)
                self._contended_tail(tails, cluster.update_contention)
            self._tied_tail(syncs, tails, top)
            self.objective = self.objective + self.tail
        md.minimize(self.objective)
        if hint is not None:
            for var, value in zip(self.b, (*hint, n)):
                md.add_hint(var, value)

    def _update(
        self,
        j: int,
        update: UpdateCost,
        cluster: Cluster,
        scale: float,
        copies: list[tuple[int, Any]],
        at: Callable[..., Any],
    ) -> cp_model.LinearExpr | cp_model.IntVar:
        """U_j in ticks: one prefix table per affine piece of U (:mod:`pipeplan.planner.updates`), and
        U_j >= every piece of the stage's bytes (own units' plus its shared copies).  U_j only
        bounds R from below, which the objective minimises, so U_j settles on the largest piece:
        U of its bytes, up to rounding."""
        pieces = []
        for k, (slope, intercept) in enumerate(update.pieces):
            per_byte = slope / cluster.devices[j].speed * scale
            U = to_ticks(self._Pw * per_byte, scale=1.0)
            copied = sum((to_ticks([nb * per_byte], 1.0)[0] * e for nb, e in copies), start=0)
            const = to_ticks([intercept / cluster.devices[j].speed * scale], 1.0)[0]
            pieces.append(at(j + 1, U, f"u{k}e") - at(j, U, f"u{k}s") + copied + const)
        if len(pieces) == 1:
            return pieces[0]
        var = self.model.new_int_var(0, self._u_top, f"U{j}")
        for piece in pieces:
            self.model.add(var >= piece)
        return var

    def _contended_tail(
        self,
        tails: list[tuple[cp_model.LinearExpr | int, cp_model.LinearExpr | int]],
        kappa_u: float,
    ) -> None:
        """K R >= K U_0 + k_K (U_j - D_j) and K R >= K (U_j - D_j) + k_K U_0 for every stage
        j > 0: updates that overlap slow each other (``Cluster.update_contention`` kappa_u).

        Valid lower bounds with no tied gradients: stage 0 is ready last, at 0, and stage j has
        b >= U_j - D_j of its update left then (it progresses at rate <= 1); from 0 both run at
        the same rate, at most 1 / (1 + kappa_u), until the shorter ends, so the later ends at
        >= max(a, b) + kappa_u min(a, b) = max(a + k b, b + k a) for any k <= min(kappa_u, 1),
        a = U_0.  When b < 0 both are implied by R >= U_0.  Coefficients must be integers:
        k = k_K / K, K = ``_KAPPA_SCALE`` and k_K rounded down, which keeps the bounds valid.
        Exact for two stages when kappa_u <= 1 is a multiple of 1 / K; otherwise a relaxation
        whose plans ``partition_cpsat`` re-evaluates."""
        scale = _KAPPA_SCALE
        k = math.floor(min(kappa_u, 1.0) * scale + 1e-9)
        if k <= 0 or len(tails) < 2:
            return
        first = tails[0][0] - tails[0][1]  # U_0 (D_0 = 0)
        for update, before in tails[1:]:
            late = update - before
            self.model.add(scale * self.tail >= scale * first + k * late)
            self.model.add(scale * self.tail >= scale * late + k * first)

    def _before(self, j: int, u: int) -> cp_model.IntVar | int:
        """The literal [b_j <= u]: stage j starts at or before unit u."""
        if j == 0 or j == self.p:
            return int(j == 0)
        key = (j, u)
        if key not in self._le:
            lit = self.model.new_bool_var(f"le{j}_{u}")
            self.model.add(self.b[j] <= u).only_enforce_if(lit)
            self.model.add(self.b[j] > u).only_enforce_if(~lit)
            self._le[key] = lit
        return self._le[key]

    def _tied_tail(
        self,
        syncs: list[tuple[int, int]],
        tails: list[tuple[cp_model.LinearExpr | int, cp_model.LinearExpr | int]],
        big: int,
    ) -> None:
        """R >= A + U_j - D_s for every stage j holding a user of a shared parameter that spans
        stages, s the stage holding its owner (the all-reduce starts when s, the earliest
        holder, finishes its backward).  Exact for one shared parameter; with several, each is
        charged alone (a lower bound of their chained all-reduces).

        spans >= [b_k <= last] - [b_k <= owner] for every inner boundary k (= 1 iff one falls
        between them); in_j >= h_j + spans - 1; own_s = [b_s <= owner] - [b_{s+1} <= owner].
        The constraint for (j, s <= j) holds when in_j = own_s = 1, relaxed by ``big`` else.
        """
        md, p = self.model, self.p
        for k, ticks in syncs:
            users = self._users[k]
            owner, last = int(users[0]), int(users[-1])
            spans = md.new_bool_var(f"spans{k}")
            inner = [self._before(i, last) - self._before(i, owner) for i in range(1, p)]
            for expr in inner:
                md.add(spans >= expr)
            md.add(spans <= sum(inner, start=0))
            own = [self._before(s, owner) - self._before(s + 1, owner) for s in range(p)]
            for j, (update, _) in enumerate(tails):
                held = md.new_bool_var(f"in{j}_{k}")
                md.add(held >= self._holds[(j, k)] + spans - 1)
                for s_idx in range(j + 1):
                    drain = tails[s_idx][1]
                    md.add(
                        self.tail
                        >= ticks + update - drain - (big + ticks) * (2 - held - own[s_idx])
                    )

    def _largest_param(
        self, j: int, biggest: list[int], at: Callable[[int, list[int], str], Any]
    ) -> cp_model.IntVar | int:
        """G_j >= the largest parameter of stage j's units (``UnitCosts.largest_param``).

        With few distinct sizes (at most ``_SIZE_LEVELS``): stage j holds a unit of size >= v
        iff the first such unit at or after b_j, ``next_v[b_j]``, comes before b_{j+1}; then
        G_j >= v.  With more, one constraint per unit: G_j >= big_u [stage j holds u], the
        membership as in :meth:`_copies`.
        """
        values = sorted({v for v in biggest if v > 0})
        if not values:
            return 0
        n = len(biggest)
        g = self.model.new_int_var(0, values[-1], f"g{j}")
        if len(values) > _SIZE_LEVELS:
            for u, v in enumerate(biggest):
                if v > 0:
                    self.model.add(g >= v * (self._before(j, u) - self._before(j + 1, u)))
            return g
        end = self.b[j + 1]
        for v in values:
            nxt, first = [n] * (n + 1), n
            for u in range(n - 1, -1, -1):
                if biggest[u] >= v:
                    first = u
                nxt[u] = first
            z = self.model.new_bool_var(f"g{j}_{v}")
            self.model.add(g >= v).only_enforce_if(z)
            self.model.add(at(j, nxt, f"nx{v}_") >= end).only_enforce_if(~z)
        return g

    def _copies(self, costs: UnitCosts, j: int) -> list[tuple[int, cp_model.LinearExpr]]:
        """(bytes, [stage j holds a copy]) of every shared parameter (cf. shared_bytes): a copy
        is held where stage j holds a user but not the owner.

        Stage j holds unit u iff [b_j <= u] - [b_{j+1} <= u] = 1; h >= that for every user u,
        and the owner's membership is subtracted exactly.
        """
        out = []
        for k, (nbytes, users) in enumerate(costs.shared):
            holds = [self._before(j, int(u)) - self._before(j + 1, int(u)) for u in users]
            h = self.model.new_bool_var(f"h{j}_{k}")
            for expr in holds:
                self.model.add(h >= expr)
            self._holds[(j, k)] = h
            self._users[k] = users
            out.append((int(nbytes), h - holds[0]))
        return out

    def solve(
        self, time_limit: float | None, cutoff: int | None
    ) -> tuple[cp_model.CpSolverStatus, cp_model.CpSolver]:
        """Run CP-SAT for at most ``time_limit`` s, only on objectives ``<= cutoff`` if given."""
        if cutoff is not None:
            self.model.add(self.objective <= cutoff)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = _WORKERS
        solver.parameters.random_seed = _SEED
        if time_limit is not None:
            solver.parameters.max_time_in_seconds = max(time_limit, 1e-3)
        return solver.solve(self.model), solver

    def starts(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        """The first unit of every stage in the solver's solution."""
        return tuple(int(solver.value(b)) for b in self.b[:-1])
