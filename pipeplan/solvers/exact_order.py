"""An exact CP-SAT model of one (family, v, m): the cuts and recomputation of p v chunks over
torch's own action order, scored as :mod:`pipeplan.planner.replay` scores them.

With the family, the chunks per rank v and the micro-batches m fixed, every rank runs the
actions of :func:`pipeplan.planner.families.action_order` in that order; the step is the
longest path through that fixed graph, whose action durations are sums of unit times, and each
rank's memory at each point of its order is a sum of its chunks' bytes.  The derivation, with
what is exact and what is bounded, is in ``docs/exact_order.md``.

Variables.  The allowed starts 0 = P_0 < P_1 < ... < P_a = n (``PlanOptions.allowed_cuts``)
split the units into segments g = [P_g, P_{g+1}).  For k = p v chunks:

    z[s][g] in {0, 1}   segment g lies in chunk s or later (z[0][g] = 1, z[k][g] = 0),
                        z[s][g] <= z[s][g + 1] and z[s + 1][g] <= z[s][g]: monotone cuts;
                        y[s][g] = z[s][g] - z[s + 1][g] (g in chunk s) and
                        e[s][g] = z[s][g] - z[s][g - 1] (chunk s starts at P_g)
    rho_s in {0, 1}     chunk s recomputes (free under ``--checkpoint auto``, else the policy's)
    t_x >= 0            the start of every action x; T the step

Durations (integer ticks, every table entry floored; :mod:`pipeplan.solvers.chunks`):

    F_s = sum_g y[s][g] (rho_s ? fc_g : f_g) / v_q + o (+ c_F rho_s, + the loss's forward)
    B_s, and for the split families I_s and W_s alike; a recomputing chunk's I is its whole
    backward and its W is empty (I_s = B_s, W_s = 0), as the runtime runs it; chunk 0's I
    is empty and its W the full backward, as torch runs it
    H_s = sum_g e[s + 1][g] transfer(x_{P_g})   one way across the cut after chunk s, paid
                                                 where chunks s and s + 1 sit on two ranks

each ``rho_s ? a : b`` two linear equalities under the literal rho_s and its negation.
Constraints: an action starts after its rank's previous one, and after its inputs (replay's
rules: F(s, i) after F(s - 1, i); B or I(s, i) after F(s, i) and the B or I of (s + 1, i);
W(s, i) after I(s, i)); F takes F_s + H_s, B and I take H_s plus their compute.  Then the
tied all-reduces (the ranks wait for the last of them and pay A) and every rank's update
U_r = sum of its chunks' U(w_s) / v_q, U the convex maximum of affine pieces
(:mod:`pipeplan.planner.updates`), one ``>=`` per piece; T >= every rank's end.  Memory: every
point of every rank's walk of :func:`pipeplan.planner.replay.peak_memory` (its held,
weight-held, transient and gradient bytes, linear in y, e and rho; the largest-parameter
temporary a maximum taken by ``>=``) plus the rank's static bytes is at most its device's.

Objective: minimise T.

Exactness.  Flooring makes every partition's model step at most its replayed step, and at most
``error_s`` below it, so ``bound_s`` (CP-SAT's proven bound) bounds every partition of this
(family, v, m) and the winner, re-scored by the replay, is within ``error_s`` of the optimum.
Bytes are integers, so memory is exact where the training state per parameter byte is a whole
number (replicated; sharded state is rounded up, which can only refuse).  The compute
contention k (``Cluster.contention``) and the updates' contention kappa_u only slow the
replay, so with either the model is a relaxation: its bound still holds, the winner's step is
the replay's, and the status says ``feasible`` with the gap.  Shared parameters are exact:
which chunks hold them, their copies and their all-reduce are 0/1 expressions of the cuts
(:mod:`pipeplan.solvers.exact_shared`; one group with users inside the model at most).

Size: k a booleans, k flags and one start per action (2 k m, or 3 k m split); the search is
exponential in the worst case, and a budget of deterministic time (a count, not a clock) stops
it with its bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from pipeplan.planner.families import action_order
from pipeplan.planner.replay import Replay
from pipeplan.solvers.chunks import ChunkPlan, fixed_flags
from pipeplan.solvers.exact_memory import BYTES, Expr, Var, add_memory
from pipeplan.solvers.exact_shared import SharedHolding
from pipeplan.solvers.schedule_search import Cuts, require

__all__ = ["TICKS", "ExactOrder", "ExactResult"]

#: Ticks in the reference time R (every action serialised, plus the tail): the resolution.
#: CP-SAT 9.15's presolve probing returned a wrong optimum on one 6-unit instance at 2**40
#: ticks and above (never at 2**36 or below, over 20 instances): keep the numbers small.
TICKS = 2**36
_WORKERS = 1
Timed = tuple[list[int], int]
"""Ticks of a chunk quantity: a coefficient per segment (times y[s][g]) and a constant."""
_SEED = 0


@dataclass(frozen=True, slots=True)
class ExactResult:
    """What one solve found: the cuts and flags, the model's step of them and CP-SAT's bound
    (seconds), CP-SAT's status, and the replay of the winner."""

    starts: list[int]
    recompute: list[bool]
    model_s: float
    """The model's step of the winner (ticks over the scale: at most its replayed step)."""
    bound_s: float
    """A lower bound on every partition and recomputation of this (family, v, m)."""
    status: str
    """``optimal`` (CP-SAT proved it and the model is exact), ``feasible``, ``infeasible`` (no
    partition fits) or ``unknown`` (the budget ran out before a first solution)."""
    exact: bool
    """Whether the model charges what the replay does (no contention, integral memory)."""
    error_s: float
    """How far below its replayed step the model can put a partition (rounding)."""
    replay: Replay | None


class ExactOrder:
    """The model of the module docstring for one :class:`ChunkPlan`; ``starts`` and
    ``recompute``, when given, fix the cuts and the flags (the model then checks one
    partition).  With ``spare`` every rank may exceed its memory by one variable, which is
    minimised instead of the step: how much more memory the tightest rank needs."""

    def __init__(
        self,
        cp: ChunkPlan,
        cuts: Cuts | None = None,
        *,
        starts: Sequence[int] | None = None,
        recompute: Sequence[bool] | None = None,
        spare: bool = False,
    ) -> None:
        self.cp = cp
        c, p, m = cp.costs, cp.p, cp.m
        n = c.n
        self.cuts = cuts or Cuts.of(cp.options, n)
        self.pos = pos = np.asarray(self.cuts.positions)
        self.k = k = p * cp.v
        self.a = a = len(pos) - 1
        if k > a:
            require(None, k, self.cuts)
        self.model = md = cp_model.CpModel()
        cl = cp.cluster
        self.scale = TICKS / self._reference()
        self.exact = not (cl.contention > 0 and p > 1 and m > 1) and not cl.update_contention
        z: list[list[Var]] = [[1] * a]
        for s in range(1, k):
            z.append([0] + [md.new_bool_var(f"z{s}_{g}") for g in range(1, a - 1)] + [1])
        z.append([0] * a)
        self.z = z
        for s in range(1, k):
            for g in range(a - 1):
                md.add(z[s][g] <= z[s][g + 1])
                if s + 1 < k:
                    md.add(z[s + 1][g] <= z[s][g])
        length = list(np.diff(pos))
        hi = self.cuts.max_units or n
        for s in range(k):
            md.add_linear_constraint(self.over(s, length), max(self.cuts.min_units, 1), hi)
        self.shared = SharedHolding(md, z, pos, cp.owner, c.shared, n)
        fixed = fixed_flags(cp.options, k)
        if recompute is not None:
            fixed = [bool(r) for r in recompute]
        self.rho: list[Var] = (
            [int(r) for r in fixed] if fixed is not None
            else [md.new_bool_var(f"rho{s}") for s in range(k)]
        )  # fmt: skip
        if starts is not None:
            self._fix(starts)
        self.horizon = 2 * TICKS
        self._times()
        self.spare = md.new_int_var(0, BYTES, "spare") if spare else None
        add_memory(self, self.spare)
        md.minimize(self.T if self.spare is None else self.spare)

    # -- the tables ---------------------------------------------------------------------------

    def _reference(self) -> float:
        """R: every action of every rank one after another, the all-reduces and every update."""
        cp, c = self.cp, self.cp.costs
        slow = min(d.speed for d in cp.cluster.devices)
        work = c.Pfc[-1] + c.Pr[-1]  # at least f + g unit by unit (the tables clip them)
        if cp.split:  # chunks may mix recomputing and I + W: both, summed, bound either
            work += c.Pf[-1] + cp.Pi[-1] + cp.Pw[-1]
        work += c.loss_f + 2 * c.loss_g + self.k * (c.call_f + c.call_b)
        actions = sum(len(r) for r in action_order(cp.family, cp.p, cp.v, cp.m))
        trip = max(cp.cluster.link.transfer_s(float(x), int(q)) for x, q in zip(c.x, c.msgs))
        shared = sum(nb for nb, _ in c.shared)
        tail = cp.update.seconds(float(c.Pw[-1]) + shared) / slow + cp.cluster.step_overhead_s
        tail += sum(cp.cluster.allreduce_s(nb) for nb, _ in c.shared)
        ref = cp.m * float(work) / slow + actions * (cp.cluster.engine_overhead_s + trip) + tail
        return max(ref, 1e-12)

    def seg(self, prefix: np.ndarray) -> list[float]:
        """Per segment g: prefix[P_{g+1}] - prefix[P_g]."""
        return list(prefix[self.pos[1:]] - prefix[self.pos[:-1]])

    def _tick_seg(self, prefix: np.ndarray, factor: float) -> list[int]:
        """Per segment g: floor(factor prefix[P_{g+1}] S) - floor(factor prefix[P_g] S), which
        a chunk sums to within one tick of its seconds (less one tick: never above)."""
        fl = np.floor(np.asarray(prefix, dtype=np.float64)[self.pos] * factor * self.scale)
        return [int(v) for v in np.diff(fl)]

    def _ticks(self, seconds: float) -> int:
        return math.floor(seconds * self.scale)

    def over(self, s: int, coef: Sequence[float]) -> Expr:
        """sum_g coef[g] y[s][g] (integer coefficients)."""
        return self._lin(self.z[s], coef) - self._lin(self.z[s + 1], coef)

    def start_at(self, s: int, at: Sequence[float]) -> Expr:
        """at[P_g] where chunk s starts: sum_g at[P_g] e[s][g] (chunk k: the end, n)."""
        if s == 0:
            return int(at[0])
        if s == self.k:
            return int(at[-1])
        zs = self.z[s]
        return self._lin(zs, [at[g] for g in range(self.a)]) - self._lin(
            zs[:-1], [at[g + 1] for g in range(self.a - 1)]
        )

    @staticmethod
    def _lin(zs: Sequence[Var], coef: Sequence[float]) -> Expr:
        const = sum(int(c) for z, c in zip(zs, coef, strict=True) if isinstance(z, int) and z)
        pairs = [(z, int(c)) for z, c in zip(zs, coef, strict=True) if not isinstance(z, int)]
        pairs = [(z, c) for z, c in pairs if c]
        if not pairs:
            return const
        return (
            cp_model.LinearExpr.weighted_sum([z for z, _ in pairs], [c for _, c in pairs]) + const
        )

    def pick(self, name: str, s: int, keep: Expr, remake: Expr) -> Expr:
        """rho_s ? remake : keep for bytes, as a variable under two enforced equalities."""
        rho = self.rho[s]
        if isinstance(rho, int):
            return remake if rho else keep
        var = self.model.new_int_var(0, BYTES, f"{name}{s}")
        self.model.add(var == keep).only_enforce_if(~rho)
        self.model.add(var == remake).only_enforce_if(rho)
        return var

    def _timed(self, name: str, s: int, keep: Timed, remake: Timed) -> Expr:
        """rho_s ? remake : keep for ticks (coefficients per segment, constant), with the
        elementwise least of the two as a bound that holds either way (the LP's floor)."""
        rho = self.rho[s]
        if isinstance(rho, int):
            coef, const = remake if rho else keep
            return self.over(s, coef) + const
        var = self.model.new_int_var(-2, self.horizon, f"{name}{s}")
        for q, lit in ((keep, ~rho), (remake, rho)):
            self.model.add(var == self.over(s, q[0]) + q[1]).only_enforce_if(lit)
        least = [min(x, y) for x, y in zip(keep[0], remake[0], strict=True)]
        self.model.add(var >= self.over(s, least) + min(keep[1], remake[1]))
        return var

    def var(self, name: str, expr: Expr) -> Expr:
        if isinstance(expr, int):
            return expr
        lo, hi = (-8, self.horizon) if name[0] == "d" else (0, BYTES)
        var = self.model.new_int_var(lo, hi, name)
        self.model.add(var == expr)
        return var

    def _fix(self, starts: Sequence[int]) -> None:
        if len(starts) != self.k or not self.cuts.valid(starts):
            raise ValueError(f"starts {list(starts)} are not {self.k} chunks over the allowed cuts")
        for s in range(1, self.k):
            for g, z in enumerate(self.z[s]):
                if not isinstance(z, int):
                    self.model.add(z == int(self.pos[g] >= starts[s]))

    # -- time ---------------------------------------------------------------------------------

    def _times(self) -> None:
        cp, c, md = self.cp, self.cp.costs, self.model
        k = self.k
        o = cp.cluster.engine_overhead_s
        trip = [cp.cluster.link.transfer_s(float(c.x[b]), int(c.msgs[b])) for b in self.pos]
        owner = cp.owner
        self.dur: dict[tuple[str, int], Expr] = {}
        self.U: list[Expr] = []
        tables = {"f": c.Pf, "g": c.Pg, "fc": c.Pfc, "r": c.Pr}
        if cp.split:
            tables |= {"i": cp.Pi, "w": cp.Pw}
        for s in range(k):
            sp = cp.cluster.devices[owner[s]].speed
            last = s == k - 1

            def t(key: str, seconds: float, sp: float = sp) -> Timed:
                return self._tick_seg(tables[key], 1 / sp), self._ticks(seconds) - 1

            lf, lg = (c.loss_f, c.loss_g) if last else (0.0, 0.0)
            b_keep = t("g", o + lg / sp)
            b_remake = t("r", o + (c.call_b + lg) / sp)
            F = self._timed("F", s, t("f", o + lf / sp), t("fc", o + (c.call_f + lf) / sp))
            B = self._timed("B", s, b_keep, b_remake)
            cross = s + 1 < k and owner[s] != owner[s + 1]
            H = self.start_at(s + 1, [self._ticks(x) for x in trip]) if cross else 0
            self.dur[("F", s)] = self.var(f"dF{s}", F + H)
            self.dur[("B", s)] = self.var(f"dB{s}", H + B)
            if cp.split:
                none: Timed = ([0] * self.a, 0)
                I = 0 if s == 0 else self._timed("I", s, t("i", o + lg / sp), b_remake)
                W = B if s == 0 else self._timed("W", s, t("w", o), none)
                self.dur[("I", s)] = self.var(f"dI{s}", H + I)
                self.dur[("W", s)] = self.var(f"dW{s}", W)
            U = md.new_int_var(0, self.horizon, f"U{s}")
            for slope, icpt in cp.update.pieces:
                coef = self._tick_seg(c.Pw, slope / sp)
                extra = self.shared.extra(s, slope * self.scale / sp, math.floor)
                md.add(U >= self.over(s, coef) + extra + self._ticks(min(icpt, 0.0) / sp) - 1)
            self.U.append(U)
        self._paths()

    def _paths(self) -> None:
        cp, md = self.cp, self.model
        order = action_order(cp.family, cp.p, cp.v, cp.m)
        n = self.k
        t0 = self._ticks(cp.cluster.step_overhead_s)
        end: dict[tuple[str, int, int], Expr] = {}
        self.start: dict[tuple[str, int, int], cp_model.IntVar] = {}
        ends: list[Expr] = []
        for r, acts in enumerate(order):
            prev: Expr = t0
            for x in acts:
                key = (x.kind, x.stage, x.microbatch)
                st = md.new_int_var(t0, self.horizon, f"t{x.kind}{x.stage}_{x.microbatch}")
                self.start[key] = st
                md.add(st >= prev)
                prev = end[key] = st + self.dur[(x.kind, x.stage)]
            ends.append(prev)
        for (kind, s, i), st in self.start.items():
            deps: list[tuple[str, int, int]] = []
            if kind == "F" and s > 0:
                deps.append(("F", s - 1, i))
            elif kind == "W":
                deps.append(("I", s, i))
            elif kind in "BI":
                deps.append(("F", s, i))
                if s < n - 1:
                    deps.append(("B", s + 1, i) if ("B", s + 1, i) in end else ("I", s + 1, i))
            for d in deps:
                md.add(st >= end[d])
        arrivals = self.shared.arrivals(ends, self._allreduce_ticks, t0, self.horizon)
        self.T = md.new_int_var(t0, self.horizon, "T")
        for q in range(cp.p):
            upd = sum(self.U[s] for s in range(n) if cp.owner[s] == q)
            for at, when in arrivals[q]:
                if isinstance(when, int):
                    md.add(self.T >= at + upd)
                else:
                    md.add(self.T >= at + upd).only_enforce_if(when)

    def _allreduce_ticks(self, nbytes: int) -> int:
        return self._ticks(self.cp.cluster.allreduce_s(nbytes))

    def hint(self, starts: Sequence[int], recompute: Sequence[bool]) -> None:
        """Start the search from these cuts and flags (the local search's plan)."""
        self.model.clear_hints()
        for s in range(1, self.k):
            for g, z in enumerate(self.z[s]):
                if not isinstance(z, int):
                    self.model.add_hint(z, int(self.pos[g] >= starts[s]))
        for rho, r in zip(self.rho, recompute, strict=True):
            if not isinstance(rho, int):
                self.model.add_hint(rho, bool(r))

    def error_s(self) -> float:
        """How far below its replayed step the model can put a partition: an action's ticks
        are at most 2 below its seconds per table it reads (its compute, less one tick; its
        transfer) plus one per constant, 6 in all; a path runs every action at most once, then
        the all-reduces (1 each), one rank's updates (3 per chunk) and the step overhead."""
        cp = self.cp
        actions = sum(len(r) for r in action_order(cp.family, cp.p, cp.v, cp.m))
        terms = 6 * actions + len(cp.costs.shared) + (3 + 2 * len(self.shared.groups)) * self.k + 1
        return terms / self.scale

    def solve(
        self, deterministic_time: float | None = None, cutoff_s: float | None = None
    ) -> ExactResult:
        """Solve (within ``deterministic_time``, CP-SAT's count of work, when given; only
        partitions below ``cutoff_s`` when given); the winner re-scored by the replay."""
        if cutoff_s is not None:
            self.model.add(self.T <= math.floor(cutoff_s * self.scale))
        solver = _solver(deterministic_time)
        code = solver.solve(self.model)
        err = self.error_s()
        if code == cp_model.INFEASIBLE:  # no partition fits (or beats the cutoff)
            below = math.inf if cutoff_s is None else math.floor(cutoff_s * self.scale) / self.scale
            return ExactResult([], [], math.inf, below, "infeasible", self.exact, err, None)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            bound = solver.best_objective_bound / self.scale
            return ExactResult([], [], math.inf, bound, "unknown", self.exact, err, None)
        starts, rc = self._read(solver)
        rep = self.cp.replay(starts, rc, timeline=True)
        proven = code == cp_model.OPTIMAL and self.exact
        return ExactResult(
            starts, rc, solver.objective_value / self.scale,
            solver.best_objective_bound / self.scale,
            "optimal" if proven else "feasible", self.exact, err, rep,
        )  # fmt: skip

    def _read(self, solver: cp_model.CpSolver) -> tuple[list[int], list[bool]]:
        starts = [0] + [
            int(self.pos[min(g for g in range(self.a) if solver.value(self.z[s][g]))])
            for s in range(1, self.k)
        ]
        return starts, [bool(solver.value(r)) for r in self.rho]

    def least_spare(
        self, deterministic_time: float | None = None
    ) -> tuple[int, list[int], list[bool]] | None:
        """With ``spare``: the fewest bytes more that the tightest rank needs, and the cuts and
        flags that need them (``None`` when the budget ends before a first solution)."""
        if self.spare is None:
            raise ValueError("build the model with spare=True")
        solver = _solver(deterministic_time)
        if solver.solve(self.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return int(solver.value(self.spare)), *self._read(solver)


def _solver(deterministic_time: float | None) -> cp_model.CpSolver:
    """CP-SAT with one worker and a fixed seed (the same answer on every machine), stopped by
    ``deterministic_time`` (its count of work, not a clock) when given."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers, solver.parameters.random_seed = _WORKERS, _SEED
    if deterministic_time is not None:
        solver.parameters.max_deterministic_time = deterministic_time
    return solver
