"""Shared parameters in the exact multi-chunk model (:mod:`pipeplan.solvers.exact_order`): which
chunks hold each, what a chunk holds beyond its units' own, and the tied all-reduce, all linear
in the cuts.

Parameters with the same user units are held, copied and all-reduced together: one group j of
N_j bytes and users u_1 < ... < u_K, owned by u_1 (its bytes are in w_{u_1}).  With g(u) the
segment of unit u, y[s][g] the model's "segment g lies in chunk s" and q(s) the rank of chunk s:

    hold[j][s]   = OR_i y[s][g(u_i)]                    chunk s holds a copy
    own[j][s]    = y[s][g(u_1)]                         chunk s owns it
    copy[j][s]   = hold[j][s] AND OR_{t > s, q(t) = q(s)} hold[j][t]
                                                        a higher chunk of its rank holds the
                                                        same tensor (counted there)
    extra_s      = sum_j N_j (hold[j][s] - own[j][s] - copy[j][s])   bytes beyond its units'
    member[j][r] = OR_{q(s) = r} hold[j][s],   multi[j] = [sum_r member[j][r] >= 2]

each OR and AND an exact 0/1 linearisation (v >= every term and v <= their sum; v <= a,
v <= b and v >= a + b - 1), or a constant where the cuts cannot change it: a user that is the
first or last unit always lies in chunk 0 or chunk k - 1, so a tied embedding and head need no
variable.  As :func:`pipeplan.planner.replay.replay` runs it, the all-reduce of group j starts
when the last member rank arrives and takes A_j = ``Cluster.allreduce_s(N_j)``, and only where
two or more ranks hold the group:

    done_j >= arrive_r + A_j multi[j]    for every member rank r (enforced by member[j][r]),

after which the members arrive at done_j.  With every holder fixed, groups with the same holding
chunks share one all-reduce, run in the replay's order.  Holders the cuts choose could make two
groups' all-reduces merge or not, so the model takes one such group, alone (T5's embedding, used
by its first unit, the decoder's embedding and its tied head); more are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from ortools.sat.python import cp_model

from pipeplan.planner.errors import UnsupportedConstraintError

__all__ = ["Expr", "SharedHolding", "Var"]

Expr = cp_model.LinearExpr | int
"""A linear expression of the exact model, or a constant."""
Var = cp_model.IntVar | int
"""A 0/1 variable of the exact model, or one the rules fix."""


class SharedHolding:
    """The 0/1 holding expressions of the module docstring for the model ``md`` over the
    staircase ``z`` (``z[s][g]``: segment g lies in chunk s or later) of k chunks on ranks
    ``owner``; ``shared`` is ``UnitCosts.shared``, (bytes, user units) per parameter."""

    def __init__(
        self,
        md: cp_model.CpModel,
        z: Sequence[Sequence[Var]],
        pos: np.ndarray,
        owner: Sequence[int],
        shared: Sequence[tuple[int, Sequence[int] | np.ndarray]],
        n_units: int,
    ) -> None:
        self.md, self.z = md, z
        self.k = k = len(owner)
        self.owner = list(owner)
        by_users: dict[tuple[int, ...], int] = {}
        for nbytes, users in shared:
            key = tuple(sorted({int(u) for u in users}))
            by_users[key] = by_users.get(key, 0) + int(nbytes)
        self.groups = [(b, u) for u, b in sorted(by_users.items())]
        inner = [u for _, u in self.groups if any(x not in (0, n_units - 1) for x in u)]
        if inner and len(self.groups) > 1:
            raise UnsupportedConstraintError(
                f"the exact model takes one group of shared parameters with users inside the "
                f"model; this profile has {len(self.groups)} groups (users "
                f"{', '.join(str(list(u)) for _, u in self.groups)})"
            )
        ranks = max(self.owner, default=-1) + 1

        def seg(u: int) -> int:
            return int(np.searchsorted(pos, u, side="right")) - 1

        self.hold: list[list[Expr]] = []
        self.own: list[list[Expr]] = []
        self.copy: list[list[Expr]] = []
        self.member: list[list[Expr]] = []
        self.multi: list[Expr] = []
        for j, (_, users) in enumerate(self.groups):
            segs = sorted({seg(u) for u in users})
            hold = [self._or(f"hold{j}_{s}", [self._y(s, g) for g in segs]) for s in range(k)]
            self.hold.append(hold)
            self.own.append([self._y(s, seg(users[0])) for s in range(k)])
            self.copy.append([
                self._and(f"copy{j}_{s}", hold[s], self._or(f"up{j}_{s}", [
                    hold[t] for t in range(s + 1, k) if self.owner[t] == self.owner[s]
                ]))
                for s in range(k)
            ])  # fmt: skip
            member = [
                self._or(f"member{j}_{r}", [hold[s] for s in range(k) if self.owner[s] == r])
                for r in range(ranks)
            ]
            self.member.append(member)
            self.multi.append(self._at_least_two(f"multi{j}", member))
        self.fixed = all(isinstance(h, int) for row in self.hold for h in row)

    # -- 0/1 algebra ----------------------------------------------------------------------------

    def _y(self, s: int, g: int) -> Expr:
        return self.z[s][g] - self.z[s + 1][g]

    def _or(self, name: str, terms: Sequence[Expr]) -> Expr:
        if any(isinstance(t, int) and t == 1 for t in terms):
            return 1
        live = [t for t in terms if not isinstance(t, int)]
        if not live:
            return 0
        v = self.md.new_bool_var(name)
        for t in live:
            self.md.add(v >= t)
        self.md.add(v <= sum(live))
        return v

    def _and(self, name: str, a: Expr, b: Expr) -> Expr:
        if isinstance(a, int) and isinstance(b, int):
            return int(a and b)
        if isinstance(a, int) or isinstance(b, int):
            const, other = (a, b) if isinstance(a, int) else (b, a)
            return other if const else 0
        v = self.md.new_bool_var(name)
        self.md.add(v <= a)
        self.md.add(v <= b)
        self.md.add(v >= a + b - 1)
        return v

    def _at_least_two(self, name: str, members: Sequence[Expr]) -> Expr:
        if all(isinstance(x, int) for x in members):
            return int(sum(members) >= 2)  # type: ignore[arg-type]
        v = self.md.new_bool_var(name)
        n = len(members)
        self.md.add(sum(members) <= 1 + (n - 1) * v)
        self.md.add(sum(members) >= 2 * v)
        return v

    # -- what a chunk holds -----------------------------------------------------------------------

    def extra(self, s: int, per_byte: float, round_up: Callable[[float], int]) -> Expr:
        """sum_j c_j (hold - own) - c'_j copy for chunk s: its shared bytes beyond its units'
        own, times ``per_byte``, each coefficient rounded by ``round_up`` (and the subtracted
        one by its mirror), so that the sum is never below the exact one where
        ``round_up`` rounds up, and never above it where it floors."""
        out: Expr = 0
        for j, (nb, _) in enumerate(self.groups):
            plus, minus = round_up(nb * per_byte), -round_up(-nb * per_byte)
            out = out + plus * (self.hold[j][s] - self.own[j][s]) - minus * self.copy[j][s]
        return out

    def copies(self, s: int) -> Expr:
        """Bytes of shared parameters of chunk s that a higher chunk of its rank also holds."""
        out: Expr = 0
        for j, (nb, _) in enumerate(self.groups):
            out = out + nb * self.copy[j][s]
        return out

    # -- the tail ---------------------------------------------------------------------------------

    def arrivals(
        self,
        arrive: list[Expr],
        ticks: Callable[[int], int],
        start: int,
        horizon: int,
    ) -> list[list[tuple[Expr, Expr]]]:
        """After the all-reduces: per rank, the (time, condition) pairs it must have reached
        before its updates (``ticks(bytes)``: an all-reduce's ticks).  Fixed holders: the
        replay's all-reduces in its order, each rank's one arrival (condition 1).  A group the
        cuts place: each rank's own arrival, and done_j where it is a member."""
        md = self.md
        if self.fixed:
            merged: dict[tuple[int, ...], int] = {}
            for j, (nb, _) in enumerate(self.groups):
                chunks = tuple(s for s in range(self.k) if self.hold[j][s])
                if len(chunks) > 1:
                    merged[chunks] = merged.get(chunks, 0) + nb
            arrive = list(arrive)
            for chunks, nb in sorted(merged.items()):
                ranks = sorted({self.owner[s] for s in chunks})
                if len(ranks) < 2:
                    continue
                done = md.new_int_var(start, horizon, "tied")
                for q in ranks:
                    md.add(done >= arrive[q] + ticks(nb))
                    arrive[q] = done
            return [[(t, 1)] for t in arrive]
        nb, _ = self.groups[0]
        done = md.new_int_var(start, horizon, "tied")
        out: list[list[tuple[Expr, Expr]]] = []
        for q, t in enumerate(arrive):
            out.append([(t, 1)])
            member = self.member[0][q]
            if isinstance(member, int) and not member:
                continue
            gate = md.add(done >= t + ticks(nb) * self.multi[0])
            if not isinstance(member, int):
                gate.only_enforce_if(member)
            out[q].append((done, member))
        return out
