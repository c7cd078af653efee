"""Seeds and local search for the schedule solver's large instances (p v chunks, any family).

A partition is the list of chunk starts ``starts`` (``starts[0] = 0``); chunk s runs on rank
``owner[s]`` (a loop or a V, :func:`pipeplan.planner.families.rank_of_stage`).  A start other
than 0 must be an allowed cut (``PlanOptions.allowed_cuts``) and every chunk must hold between
``min_units`` and ``max_units`` units: :class:`Cuts` states these rules once, and everything
here keeps to them.

Seeds, with w_u = (f_u + g_u) / speed the unit's plain forward and backward at m:

``minmax``
    The contiguous partition into k chunks with the least largest chunk, exact over the
    allowed cuts and the unit counts (a DP over the allowed starts, O(k a^2) for a allowed
    starts, vectorised).
``uniform``
    torchtitan's equal split (equal unit counts), snapped to the allowed cuts.
``balanced``
    Rank-balanced chunks: for a target rank load L, the chunks are filled in order, chunk s
    taking units while that brings it closer to its rank's fair share (L minus what the rank
    holds already) / (the rank's chunks still to fill).  The interleaved and V schedules run
    about m L + (p - 1) max_s w_s (the busiest rank's load per micro-batch, plus a ramp of one
    chunk per rank), which this targets and the min-max partition does not (its ties pack the
    first chunks full and leave the last ones almost empty).  L runs over a grid from the work
    per rank up; the seeds with the least estimate m L_max + (p - 1) w_max are kept.
``stages``
    A 1F1B plan's stages each split into v chunks by the min-max rule.

The local search moves one cut to the neighbouring allowed start, or two adjacent cuts
together (a chunk slides), and keeps a move when the replay's step falls, or stays equal
(to 1e-12) while the ranks' busy times, largest first, shrink lexicographically: a strict
decrease of (step, busy) each move, so it ends; it also stops when its budget of replays is
spent.  Moves that
touch the busiest rank's chunks are tried first.  From each local optimum it kicks a few
random cuts (seeded) and descends again, until a dozen kicks in a row find nothing better
(an iterated local search: the replay's step is flat in most single moves, because the
optimizer updates and the end ranks' drain, not the balance, set it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import PlanOptions

__all__ = ["Cuts", "balanced_seeds", "local_search", "minmax_starts", "snap_uniform"]

Score = tuple[float, tuple[float, ...], int]
"""(step, the ranks' busy times largest first, the busiest rank): the local search minimises
the first two, lexicographically."""


@dataclass(frozen=True, slots=True)
class Cuts:
    """Where chunks may start: ``positions`` (0, the allowed cuts, n) and the unit counts."""

    n: int
    positions: tuple[int, ...]
    min_units: int = 1
    max_units: int | None = None

    @classmethod
    def of(cls, options: PlanOptions, n: int) -> Cuts:
        inner = range(1, n) if options.allowed_cuts is None else options.allowed_cuts
        pos = (0, *(b for b in inner if 0 < b < n), n)
        return cls(n, pos, options.min_units, options.max_units)

    def valid(self, starts: Sequence[int]) -> bool:
        ends = [*starts[1:], self.n]
        allowed = set(self.positions)
        hi = self.max_units or self.n
        return starts[0] == 0 and all(
            s in allowed and self.min_units <= e - s <= hi
            for s, e in zip(starts, ends, strict=True)
        )

    def neighbours(self, b: int) -> tuple[int | None, int | None]:
        """The allowed starts just below and just above b."""
        i = int(np.searchsorted(self.positions, b))
        lo = self.positions[i - 1] if i > 0 else None
        j = i + 1 if i < len(self.positions) and self.positions[i] == b else i
        hi = self.positions[j] if j < len(self.positions) else None
        return lo, hi


def minmax_starts(weights: np.ndarray, k: int, cuts: Cuts) -> list[int] | None:
    """The k chunk starts with the least largest chunk sum over ``cuts``; ``None`` when no
    partition into k chunks keeps to them.  D[j][b] = min over a < b of max(D[j-1][a],
    S_b - S_a), a and b allowed starts (the unit count b - a within the bounds)."""
    pos = np.asarray(cuts.positions)
    S = np.concatenate([[0.0], np.cumsum(weights)])[pos]
    size = pos[None, :] - pos[:, None]
    ok = (size >= cuts.min_units) & (size <= (cuts.max_units or cuts.n))
    span = np.where(ok, S[None, :] - S[:, None], np.inf)
    D = np.full(len(pos), np.inf)
    D[0] = 0.0
    arg = []
    for _ in range(k):
        M = np.maximum(D[:, None], span)
        a = M.argmin(axis=0)
        D = M[a, np.arange(len(pos))]
        arg.append(a)
    if not np.isfinite(D[-1]):
        return None
    out, b = [], len(pos) - 1
    for j in range(k - 1, -1, -1):
        b = int(arg[j][b])
        out.append(int(pos[b]))
    return out[::-1]


def snap_uniform(k: int, cuts: Cuts) -> list[int] | None:
    """torchtitan's equal split (sizes differing by at most one), each cut moved to the nearest
    allowed start; ``None`` when that breaks a rule."""
    size, extra = divmod(cuts.n, k)
    starts, at = [0], 0
    for j in range(k - 1):
        at += size + (j < extra)
        i = int(np.abs(np.asarray(cuts.positions) - at).argmin())
        starts.append(cuts.positions[i])
    return starts if cuts.valid(starts) else None


def balanced_seeds(
    weights: np.ndarray, owner: Sequence[int], speeds: Sequence[float], m: int, cuts: Cuts,
    keep: int = 3, grid: int = 24,
) -> list[list[int]]:  # fmt: skip
    """The ``balanced`` seeds (module docstring): the ``keep`` best by m L_max + (p - 1) w_max
    over a grid of target loads from the work per rank to twice it."""
    pos = np.asarray(cuts.positions)
    S = np.concatenate([[0.0], np.cumsum(weights)])
    p, k = len(speeds), len(owner)
    base = float(S[-1]) / sum(speeds)
    found: dict[tuple[int, ...], float] = {}
    for L in base * np.linspace(1.0, 2.0, grid):
        starts = _fill(S, pos, owner, speeds, float(L), cuts)
        if starts is None:
            continue
        ends = [*starts[1:], cuts.n]
        chunk = [(S[e] - S[s]) / speeds[owner[j]] for j, (s, e) in enumerate(zip(starts, ends))]
        load = [0.0] * p
        for j, c in enumerate(chunk):
            load[owner[j]] += c
        found[tuple(starts)] = m * max(load) + (p - 1) * max(chunk) * k / p
    return [list(s) for s in sorted(found, key=found.__getitem__)[:keep]]


def _fill(
    S: np.ndarray, pos: np.ndarray, owner: Sequence[int], speeds: Sequence[float], L: float,
    cuts: Cuts,
) -> list[int] | None:  # fmt: skip
    k = len(owner)
    left = [0] * len(speeds)
    for q in owner:
        left[q] += 1
    load = [0.0] * len(speeds)
    starts, i = [0], 0  # i indexes pos
    last = len(pos) - 1
    for s in range(k - 1):
        q = owner[s]
        share = max(L - load[q], 0.0) * speeds[q] / left[q]
        # the furthest start that leaves one allowed start per remaining chunk
        hi = last - (k - 1 - s)
        j = i + 1
        while j < hi and abs(S[pos[j + 1]] - S[pos[i]] - share) < abs(
            S[pos[j]] - S[pos[i]] - share
        ):
            j += 1
        if j > hi:
            return None
        load[q] += (S[pos[j]] - S[pos[i]]) / speeds[q]
        left[q] -= 1
        starts.append(int(pos[j]))
        i = j
    return starts if cuts.valid(starts) else None


def local_search(
    starts: list[int],
    score: Callable[[list[int]], Score],
    owner: Sequence[int],
    cuts: Cuts,
    stop: Callable[[], bool],
    first: Score | None = None,
    patience: int = 12,
    seed: int = 0,
) -> tuple[list[int], Score]:
    """The local search of the module docstring from ``starts`` (``score`` its objective),
    iterated: from each local optimum, up to ``patience`` kicks in a row that do not lead to a
    better one (a kick moves 2 to 4 random cuts by 1 to 3 allowed starts, seeded).  It ends
    early once ``stop()`` (a budget of replays, which keeps the result the same on every
    machine; or a wall-clock limit, which does not)."""
    best, best_s = _descend(list(starts), first or score(starts), score, owner, cuts, stop)
    rng = np.random.default_rng(seed)
    misses = 0
    while misses < patience and not stop() and len(best) > 1:
        kicked = _kick(best, cuts, rng)
        if kicked is None:
            misses += 1
            continue
        cand, cand_s = _descend(kicked, score(kicked), score, owner, cuts, stop)
        if _better(cand_s, best_s):
            best, best_s, misses = cand, cand_s, 0
        else:
            misses += 1
    return best, best_s


def _better(a: Score, b: Score) -> bool:
    return a[0] < b[0] * (1 - 1e-12) or (a[0] <= b[0] * (1 + 1e-12) and a[1] < b[1])


def _kick(starts: list[int], cuts: Cuts, rng: np.random.Generator) -> list[int] | None:
    k = len(starts)
    pos = cuts.positions
    index = {b: i for i, b in enumerate(pos)}
    cand = list(starts)
    for j in rng.choice(np.arange(1, k), size=min(k - 1, int(rng.integers(2, 5))), replace=False):
        at = index[cand[j]] + int(rng.choice([-3, -2, -1, 1, 2, 3]))
        if 0 < at < len(pos) - 1:
            cand[j] = pos[at]
    cand = sorted(cand)
    if len(set(cand)) < k or not cuts.valid(cand) or cand == starts:
        return None
    return cand


def _descend(
    best: list[int],
    best_s: Score,
    score: Callable[[list[int]], Score],
    owner: Sequence[int],
    cuts: Cuts,
    stop: Callable[[], bool],
) -> tuple[list[int], Score]:
    improved = True
    while improved and not stop() and np.isfinite(best_s[0]):
        improved = False
        for cand in _moves(best, best_s, owner, cuts):
            if stop():
                break
            s = score(cand)
            if _better(s, best_s):
                best, best_s, improved = cand, s, True
                break
    return best, best_s


def _moves(starts: list[int], now: Score, owner: Sequence[int], cuts: Cuts) -> list[list[int]]:
    k = len(starts)
    busy_rank = now[2]
    out: list[tuple[int, list[int]]] = []
    for j in range(1, k):
        for width in (1, 2):
            if j + width > k:
                continue
            for d in (-1, 1):
                cand = list(starts)
                ok = True
                for t in range(j, j + width):
                    lo, hi = cuts.neighbours(cand[t])
                    nb = lo if d < 0 else hi
                    if nb is None:
                        ok = False
                        break
                    cand[t] = nb
                if (
                    not ok
                    or not cuts.valid(cand)
                    or any(b <= a for a, b in itertools.pairwise(cand))
                ):
                    continue
                touches = {owner[t] for t in range(j - 1, min(j + width, k))}
                out.append((0 if busy_rank in touches else 1, cand))
    out.sort(key=lambda x: x[0])
    return [c for _, c in out]


def require(starts: list[int] | None, k: int, cuts: Cuts) -> list[int]:
    """``starts``, or the error that no partition into k chunks keeps to the rules."""
    if starts is None:
        raise InvalidRequestError(
            f"no partition of {cuts.n} units into {k} chunks keeps to the allowed cuts "
            f"({len(cuts.positions) - 2} of them) and {cuts.min_units}..{cuts.max_units or cuts.n} "
            "units per chunk; plan fewer stages or fewer chunks per rank"
        )
    return starts
