"""The memory constraints of the exact multi-chunk model (:mod:`pipeplan.solvers.exact_order`):
each rank's walk of :func:`pipeplan.planner.replay.peak_memory`, linear in the cuts and flags.

Per chunk s, with y, e and rho the model's variables and the tables of
:mod:`pipeplan.solvers.chunks` summed over the segments it holds (bytes, integers):

    A_s   = sum_g y[s][g] a_g                           its activations per micro-batch
    R_s   = rho_s A_s                                   what a recomputing chunk remakes
    x_in  = sum_g e[s][g] x_{P_g},  x_out the same at chunk s + 1 (0 past the last)
    w_s   = sum_g y[s][g] w_g + extra_s, the shared bytes it holds beyond its units' own
            (:mod:`pipeplan.solvers.exact_shared`)
    static_s = (params + optimizer states) w_s + m (x_in + x_out)
    held_s   = x_out + A_s - R_s [+ y + a_loss on the last chunk]
    wheld_s  = (1 - rho_s) (held_s + sum_g y[s][g] d_g [- y - a_loss])   split families
    trans_s  = R_s + [s > 0] x_in [+ 2 y on the last chunk]
    grads_s  = (gradients per byte) w_s
    temp_s   >= [m > 1] max(0, big_s - R_s),  big_s >= big_g y[s][g] for every g
    tfirst_s >= [m > 1] max(0, min(copies_s, big_s) - R_s)   copies_s: its shared bytes a
                higher chunk of its rank also holds

(``rho_s ? a : b`` as two enforced equalities; a maximum by ``>=``, exact because every one
appears with a positive sign in a ``<=``).  The walk is independent of the values: the order
fixes which chunk quantities are live at each point (:func:`walk_points`), so every point is
one linear constraint, sum over the rank's chunks of static_s + the point <= the device's
memory.  Points that repeat (the steady phase) are stated once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from ortools.sat.python import cp_model

from pipeplan.planner.families import Action, action_order
from pipeplan.solvers.chunks import ChunkPlan
from pipeplan.solvers.exact_shared import Expr, SharedHolding, Var

__all__ = ["BYTES", "Expr", "Model", "Var", "add_memory", "walk_points"]


#: Bytes' domain (memory variables).
BYTES = 2**46

Point = tuple[tuple[tuple[str, int], int], ...]
"""A point of a walk: (quantity, chunk) -> how many of it are live, sorted."""


def walk_points(acts: Sequence[Action]) -> set[Point]:
    """The points of :func:`pipeplan.planner.replay.peak_memory`'s walk of one rank's list,
    each the live chunk quantities (``held``, ``wheld``, ``grads``, ``trans``, ``temp``,
    ``temp_first``) with their multiplicities; the empty point (nothing live) included.

    >>> sorted(walk_points([Action("F", 0, 0), Action("B", 0, 0)]))[-1]
    ((('held', 0), 1), (('temp_first', 0), 1), (('trans', 0), 1))
    """
    live: dict[tuple[str, int], int] = {}
    points: set[Point] = {()}
    made: set[int] = set()

    def add(key: tuple[str, int], coef: int) -> None:
        live[key] = live.get(key, 0) + coef

    def point(*extra: tuple[str, int]) -> None:
        now = dict(live)
        for e in extra:
            now[e] = now.get(e, 0) + 1
        points.add(tuple(sorted(kv for kv in now.items() if kv[1])))

    for x in acts:
        s = x.stage
        extra = ("temp", s) if s in made else ("temp_first", s)
        if x.kind == "F":
            add(("held", s), 1)
            point()
        elif x.kind == "B" or (x.kind == "W" and s == 0):  # chunk 0's W: the full backward
            point(("trans", s), extra)
            add(("held", s), -1)
            if s not in made:
                made.add(s)
                add(("grads", s), 1)
                point()
        elif x.kind == "I":
            if s > 0:  # chunk 0's I does nothing
                point(("trans", s))
                add(("wheld", s), 1)
                add(("held", s), -1)
                point()
        else:
            if s not in made:
                made.add(s)
                add(("grads", s), 1)
            point(extra)
            add(("wheld", s), -1)
    return points


class Model(Protocol):
    """What the memory constraints read of :class:`pipeplan.solvers.exact_order.ExactOrder`."""

    cp: ChunkPlan
    model: cp_model.CpModel
    k: int
    a: int
    pos: np.ndarray
    z: list[list[Var]]
    exact: bool

    def seg(self, prefix: np.ndarray) -> list[float]: ...
    def over(self, s: int, coef: Sequence[float]) -> Expr: ...
    def start_at(self, s: int, at: Sequence[float]) -> Expr: ...
    def pick(self, name: str, s: int, keep: Expr, remake: Expr) -> Expr: ...
    def var(self, name: str, expr: Expr) -> Expr: ...

    shared: SharedHolding


def add_memory(xo: Model, spare: cp_model.IntVar | None = None) -> None:
    """Every rank's points under its device's memory (plus ``spare`` bytes, when given: the
    model that finds how much more memory the tightest rank needs)."""
    cp, c, md = xo.cp, xo.cp.costs, xo.model
    k, m = xo.k, cp.m
    st = cp.state
    keep_f = st.params + st.optimizer
    whole = all(float(f).is_integer() for f in (keep_f, st.grads))
    xo.exact = xo.exact and whole

    def up(v: float) -> int:
        """Bytes as an integer: exact for whole factors, else rounded up (refuses, never
        admits, a partition the replay would not fit)."""
        return round(v) if whole else math.ceil(v - 1e-9 * abs(v))

    x = [float(v) for v in c.x[xo.pos]]
    acts_g, w_g = xo.seg(c.Pa), xo.seg(c.Pw)
    d_g = xo.seg(cp.Ph) if cp.split else [0.0] * xo.a
    big_g = [float(c.largest_param(int(lo), int(hi) - 1)) for lo, hi in
             zip(xo.pos[:-1], xo.pos[1:], strict=True)]  # fmt: skip
    ends = int(c.out + c.loss_a)
    table: dict[str, list[Expr]] = {
        name: [] for name in ("held", "wheld", "trans", "grads", "temp", "temp_first")
    }
    static: list[Expr] = []
    for s in range(k):
        last = s == k - 1
        x_in, x_out = xo.start_at(s, x), xo.start_at(s + 1, x)
        acts = xo.over(s, acts_g)
        remade = xo.pick("a", s, 0, acts)
        static.append(xo.over(s, [up(w * keep_f) for w in w_g])
                      + xo.shared.extra(s, keep_f, up) + m * (x_in + x_out))  # fmt: skip
        held = xo.var(f"h{s}", x_out + acts - remade + (ends if last else 0))
        table["held"].append(held)
        keep = held + xo.over(s, d_g) - (ends if last else 0)
        table["wheld"].append(xo.var(f"wh{s}", xo.pick("wh", s, keep, 0) if cp.split else 0))
        trans = remade + (x_in if s > 0 else 0) + (2 * int(c.out) if last else 0)
        table["trans"].append(xo.var(f"tr{s}", trans))
        grads = xo.over(s, [up(w * st.grads) for w in w_g]) + xo.shared.extra(s, st.grads, up)
        table["grads"].append(xo.var(f"gr{s}", grads))
        temp: Expr = 0
        first: Expr = 0
        if m > 1 and max(big_g) > 0:
            big = md.new_int_var(0, int(max(big_g)), f"big{s}")
            for g, b in enumerate(big_g):
                if b > 0:
                    md.add(big >= int(b) * (xo.z[s][g] - xo.z[s + 1][g]))
            temp = md.new_int_var(0, BYTES, f"tmp{s}")
            md.add(temp >= big - remade)
            copies = xo.shared.copies(s)
            if not isinstance(copies, int) or copies > 0:
                least = md.new_int_var(0, BYTES, f"mb{s}")
                md.add_min_equality(least, [copies, big])
                first = md.new_int_var(0, BYTES, f"tf{s}")
                md.add(first >= least - remade)
        table["temp"].append(temp)
        table["temp_first"].append(first)
    order = action_order(cp.family, cp.p, cp.v, m)
    for r, acts_r in enumerate(order):
        limit = cp.cluster.devices[r].memory_bytes
        base = sum(static[s] for s in sorted({a.stage for a in acts_r}))
        for pt in walk_points(acts_r):
            used = base + sum(coef * table[name][s] for (name, s), coef in pt)
            md.add(used <= limit + (spare if spare is not None else 0))
