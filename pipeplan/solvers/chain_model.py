"""Chains of torch's order minimised over partitions by CP-SAT: what weighted means cannot see.

:mod:`pipeplan.solvers.chain_bound` bounds min over partitions of max_k chain_k by weighted
means of the chains, which cannot see that whole units do not divide evenly among ranks (34
units of the 7B profile over 8 ranks: some rank holds 5 where the mean is 4.25, and every
weighted mean can put the fifth on a rank of small weight).  Here the same chains (rows of
coefficients over chunks and the terms of :data:`~pipeplan.solvers.chain_bound.TERMS`) are an
integer programme over the cuts:

    variables   x_s, the index among the allowed starts where chunk s begins (x_0 = 0,
                x_S = the end), increasing, each chunk within ``min_units``/``max_units``
    minimise    z >= c + sum_{s, t} K[k, s, t] term_t(chunk s)   for every chain k

Each term of a chunk is a difference of prefix sums read at its two cuts (CP-SAT's element
constraints) plus constants, with per unit the least over keeping and recomputing for each term
apart (forward min(f_u, fc_u); full backward min(g_u, r_u); the descent's I the least of those
and i_u; the backward work min(g_u, r_u, i_u + w_u); W w_u, or 0 where recomputing fuses it;
the checkpoint calls' own costs left out) and the optimizer update through one affine piece
of its cost, U(w) >= s_k w + min(c_k, 0): each at most what the replay charges the chunk in
either mode, so z is at most every partition's step (the chains' proofs), memory aside: this
bound is over every partition, fitting or not.

Levels, then the least z.  It first asks whether every chain can stay within each of
:data:`LEVELS` of the ``target`` (the plan in hand's step): an INFEASIBLE answer proves the
gap within that level, and CP-SAT refutes such a question far sooner than it closes the
optimisation's gap.  A partition that does stay within it is replayed as its longest path
(:func:`~pipeplan.solvers.chain_bound.path_row`), which joins the rows (path generation), and
the question is asked again, until it is refuted, the path is already a row (a partition
within the level, up to the relaxations above and contention) or the budget ends.  Whatever
level is not proven, it then minimises z, again with path generation, for the bound CP-SAT
proves.  Prefix sums are floored to integer ticks of ``target`` / :data:`TICKS` seconds,
which can lower each span, transfer or constant by at most one tick, so the bound subtracts
three ticks per coefficient of the longest row (a few parts in a million: why the levels
stand a little above 99 % and 99.9 %).  CP-SAT runs one worker with a fixed seed under a
deterministic-time limit (a count of its work, not a clock), shared by all its solves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from ortools.sat.python import cp_model

from pipeplan.planner.families import FAMILIES, rank_of_stage
from pipeplan.planner.types import Cluster, PlanOptions, Profile
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.planner.updates import update_cost
from pipeplan.solvers.chain_bound import (
    TERMS,
    chain_coefficients,
    modes_of,
    path_row,
    runs_fused_backward,
    unshared_params,
)
from pipeplan.solvers.path_bound import cut_transfers
from pipeplan.solvers.schedule_search import Cuts

__all__ = ["LEVELS", "ROUNDS", "TICKS", "ModelBound", "chain_model_bound"]

#: Integer ticks per ``target`` (:func:`chain_model_bound`).  Finer ticks would shrink the
#: slack, but at 10**13 CP-SAT (9.15) returned an OPTIMAL minimum above a partition's chains
#: on a brute-force instance: its coefficients' range, not this model, so 10**9 it is.
TICKS = 10**9

#: The fractions of the target :func:`chain_model_bound` tries to prove first (within 1 %,
#: then 0.1 %, each a little above so that the flooring's slack leaves it there).  The target
#: itself is not among them: the plan in hand keeps every chain within it.
LEVELS = (0.991, 0.9991)

#: Solves of path generation at most (each gets the deterministic time the ones before left).
ROUNDS = 8


class ModelBound(NamedTuple):
    """:func:`chain_model_bound`'s answer: the bound and CP-SAT's deterministic time spent."""

    bound: float
    time: float


def chain_model_bound(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions,
    family: str,
    v: int,
    m: int,
    *,
    target: float,
    rows: Sequence[np.ndarray] = (),
    deterministic_time: float = 1.0,
) -> ModelBound:
    """CP-SAT's proven lower bound on min over partitions of max_k (c + chain_k) (module
    docstring), over :func:`~pipeplan.solvers.chain_bound.chain_coefficients`' chains, ``rows``
    and the longest paths path generation adds, after ``deterministic_time`` of its work;
    ``scale`` is a time of the step's order; 0 where no partition keeps to the cuts."""
    p = cluster.n_stages
    owner = rank_of_stage(family, p, v)
    k = len(owner)
    split = FAMILIES[family].split_backward
    c = unit_costs(profile, m)
    n = c.n
    cuts = Cuts.of(options, n)
    pos = np.asarray(cuts.positions)
    a = len(pos)
    if a - 1 < k:
        return ModelBound(0.0, 0.0)
    q = target / TICKS
    o = cluster.engine_overhead_s
    modes = modes_of(profile, cluster, options, family, v, m, memory=False)

    fc, rr = np.diff(c.Pfc), np.diff(c.Pr)
    fwd_u, bwd_u = np.minimum(c.f, fc), np.minimum(c.g, rr)
    iu = wu = np.zeros(n)
    if split:
        ts = [u.timings[profile.batch_size // m] for u in profile.units]
        iu = np.array([t.backward_input_s or 0.0 for t in ts])
        wu = np.array([t.backward_weight_s or 0.0 for t in ts])
    # a split family's chunk keeps (I, W; a fused B only where the order runs one) or
    # recomputes (one fused I of its recomputing backward)
    either = bwd_u if runs_fused_backward(family, p, v, m) else rr
    desc_u = np.minimum(either, iu) if split else bwd_u
    work_u = np.minimum(either, iu + wu) if split else bwd_u
    weight_u = np.zeros(n) if options.checkpoint != "never" else wu
    plain = unshared_params(c)
    upd = update_cost(profile, options.optimizer, cluster)
    slope, const = 0.0, 0.0
    if upd.pieces and all(sl >= 0 for sl, _ in upd.pieces):
        total = float(plain.sum())
        slope, const = max(upd.pieces, key=lambda sc: sc[0] * total / k + sc[1])
        const = min(const, 0.0)
    half = cut_transfers(c, cluster, pos)

    md = cp_model.CpModel()
    x = [md.new_constant(0)]
    x += [md.new_int_var(s, a - 1 - (k - s), f"x{s}") for s in range(1, k)]
    x.append(md.new_constant(a - 1))
    at = [md.new_int_var(0, n, f"p{s}") for s in range(k + 1)]
    pos_list = [int(b) for b in pos]
    for s in range(k + 1):
        md.add_element(x[s], pos_list, at[s])
    lo, hi = max(cuts.min_units, 1), cuts.max_units or n
    for s in range(k):
        md.add(x[s + 1] >= x[s] + 1)
        md.add(at[s + 1] - at[s] >= lo)
        md.add(at[s + 1] - at[s] <= hi)

    reads: dict[tuple[int, str], cp_model.IntVar] = {}

    def read(s: int, name: str, table: list[int]) -> cp_model.IntVar:
        """The prefix table ``name`` at chunk boundary s (CP-SAT's element constraint)."""
        key = (s, name)
        if key not in reads:
            var = md.new_int_var(min(table), max(table), f"{name}{s}")
            md.add_element(x[s], table, var)
            reads[key] = var
        return reads[key]

    tables: dict[tuple[str, float], list[int]] = {}

    def span(s: int, name: str, per_unit: np.ndarray, speed: float) -> cp_model.LinearExpr:
        key = (name, speed)
        if key not in tables:
            prefix = np.concatenate([[0.0], np.cumsum(per_unit)])[pos] / speed
            tables[key] = [math.floor(v / q) for v in prefix]
        table = tables[key]
        return read(s + 1, f"{name}@{speed}", table) - read(s, f"{name}@{speed}", table)

    half_table = [math.floor(h / q) for h in half]

    def tick(seconds: float) -> int:
        return math.floor(seconds / q)

    # every term of every chunk as a linear expression in ticks
    term_expr: list[list[cp_model.LinearExpr | int]] = []
    loss_f, loss_g = c.loss_f, c.loss_g
    for s in range(k):
        sp = cluster.devices[owner[s]].speed
        last = s == k - 1
        h: cp_model.LinearExpr | int = 0
        if not last and owner[s] != owner[s + 1]:
            h = read(s + 1, "half", half_table)
        lf, lg = (loss_f, loss_g) if last else (0.0, 0.0)
        first_split = split and s == 0
        exprs: list[cp_model.LinearExpr | int] = [
            span(s, "fwd", fwd_u, sp) + tick(lf / sp + o) + h,
            span(s, "bwd", bwd_u, sp) + tick(lg / sp + o) + h,
            h if first_split else span(s, "desc", desc_u, sp) + tick(lg / sp + o) + h,
            span(s, "bwd" if first_split else "work", bwd_u if first_split else work_u, sp)
            + tick(lg / sp + o) + h,
            span(s, "upd", plain * slope, sp) + tick(const / sp),
            (span(s, "bwd", bwd_u, sp) + tick(o)) if first_split
            else (span(s, "weight", weight_u, sp) + (tick(o) if options.checkpoint == "never"
                                                      else 0)),
        ]  # fmt: skip
        term_expr.append(exprs)

    z = md.new_int_var(0, 2**62 // 4, "z")
    seen: list[np.ndarray] = []

    def chain(row: np.ndarray) -> Any:
        return sum(
            int(row[s, t]) * term_expr[s][t]
            for s in range(k) for t in range(len(TERMS)) if row[s, t]
        )  # fmt: skip

    for row in [*chain_coefficients(family, p, v, m), *rows]:
        if not any((row == r).all() for r in seen):
            seen.append(np.asarray(row))
            md.add(z >= chain(row))
    c0 = cluster.step_overhead_s
    left = [deterministic_time]

    def solve(model: cp_model.CpModel) -> tuple[Any, cp_model.CpSolver]:
        solver = cp_model.CpSolver()
        solver.parameters.num_workers, solver.parameters.random_seed = 1, 0
        solver.parameters.max_deterministic_time = max(left[0], 0.0)
        status = solver.solve(model)
        left[0] -= solver.response_proto.deterministic_time
        return status, solver

    def longest(solver: cp_model.CpSolver) -> np.ndarray | None:
        """The longest path of the solver's partition, where it is not a row yet."""
        idx = [int(solver.value(v)) for v in x]
        values = np.array([
            next((mode[:, idx[s], idx[s + 1]] for mode in modes[s]
                  if np.isfinite(mode[0, idx[s], idx[s + 1]])), np.full(len(TERMS), np.inf))
            for s in range(k)
        ])  # fmt: skip
        row = path_row(family, p, v, m, values) if np.isfinite(values).all() else None
        if row is None or any((row == r).all() for r in seen):
            return None
        return row

    def slack() -> int:
        return 3 * max(int(r.sum()) for r in seen)  # ticks the flooring can take off a row

    best = 0.0
    # first: can every chain stay within each level of the target?  INFEASIBLE proves it cannot
    for level in LEVELS:
        tau = math.floor((level * target - c0) / q)
        proven = False
        for _ in range(ROUNDS):
            if left[0] <= 0:
                return ModelBound(best, deterministic_time - left[0])
            trial = md.clone()
            trial.add(trial.get_int_var_from_proto_index(z.index) <= tau)
            trial.clear_objective()
            status, solver = solve(trial)
            if status == cp_model.INFEASIBLE:
                best, proven = max(best, (tau - slack()) * q + c0), True
                break
            row = longest(solver) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
            if row is None:  # a partition within the level (up to the relaxations), or no time
                break
            seen.append(row)
            md.add(z >= chain(row))
        if not proven:
            break
    else:
        return ModelBound(best, deterministic_time - left[0])
    # else: the least z, with path generation, for whatever bound it proves
    md.minimize(z)
    for _ in range(ROUNDS):
        if left[0] <= 0:
            break
        status, solver = solve(md)
        if status == cp_model.INFEASIBLE:  # pragma: no cover - z is free above the chains
            return ModelBound(0.0, deterministic_time - left[0])
        best = max(best, (solver.best_objective_bound - slack()) * q + c0)
        row = longest(solver) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
        if row is None:
            break
        seen.append(row)
        md.add(z >= chain(row))
        md.clear_hints()
        idx = [int(solver.value(v)) for v in x]
        for var, value in zip(x[1:-1], idx[1:-1], strict=True):
            md.add_hint(var, value)
    return ModelBound(max(best, 0.0), deterministic_time - left[0])
