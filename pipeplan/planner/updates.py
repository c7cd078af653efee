"""The optimizer update's cost as a function of the parameter bytes a stage holds.

A stage updates its parameters once per step, after its last backward.  An update streams
the parameters, their gradients and the optimizer's state through memory (Adam: four lists,
in several passes), so its time is not proportional to the bytes: while a stage's lists fit
in the cache the passes after the first hit it, and past that every pass goes to memory.
Measured on the GPT of ``benchmarks/quality`` (2 ranks on a 2-vCPU EPYC host, 32 MiB of L3,
cold cache before each step): 8.4 MB of parameters took 5.3 ms, 11.6 MB 8.0 ms and 14.0 MB
12.1 ms, 0.62 to 0.86 ms per MB, where the linear rate of the whole model's step had charged
0.66 ms per MB throughout.

So the profiler times one step of each optimizer on growing prefixes of the model's units
(``Profile.update_curve``: (bytes, seconds) points), and the cost model fits

    U(w) = a w + q w^2,   a, q >= 0          (least squares, non-negative)

to them: a convex, non-decreasing curve that smooths the host's noise.  The planner uses its
piecewise-linear interpolation at the measured sizes (and at 0), extended beyond the last size
by the last chord's slope, which stays convex:

    U(w) = max_k (slope_k w + intercept_k),   U(0) = 0,

a maximum of affine pieces (the first through the origin, the rest with intercepts <= 0) that a
CP-SAT model takes as one linear constraint per piece.  (A fixed cost per step, such as the
optimizer's per-tensor work, is left to the curve's slope: a constant would charge stages
without parameters.)
Profiles without a curve (made before it was measured) give one piece through the origin,
the whole model's step ``Profile.update_s`` times the stage's share of the bytes.

The updates' tail (:func:`update_tail`): each stage's update starts after its last backward
(and its tied all-reduces), and updates under way at once share the devices' cores and memory
by egalitarian processor sharing with ``Cluster.update_contention`` kappa_u
(:func:`shared_ends`); see :mod:`pipeplan.planner.costmodel`, "Updates" onwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations, pairwise

import numpy as np

from pipeplan.planner.collectives import collective_cost
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Cluster, Profile, TiedSync
from pipeplan.planner.unitcosts import tables

__all__ = ["UpdateCost", "fit_update_cost", "shared_ends", "update_cost", "update_tail"]


@dataclass(frozen=True, slots=True)
class UpdateCost:
    """U(w) = max(0, max_k slope_k w + intercept_k) for w > 0 and 0 at w = 0: seconds of one
    optimizer step over w parameter bytes on a device of speed 1."""

    pieces: tuple[tuple[float, float], ...] = ()
    """(slope in seconds per byte, intercept in seconds) of each affine piece; none: free."""

    def __bool__(self) -> bool:
        return any(s > 0 or c > 0 for s, c in self.pieces)

    def __call__(self, nbytes: float | np.ndarray) -> np.ndarray:
        """U of ``nbytes`` (a number or an array of them), as an array."""
        w = np.asarray(nbytes, dtype=np.float64)
        if not self.pieces:
            return np.zeros(w.shape)
        lines = [s * w + c for s, c in self.pieces]
        return np.where(w > 0, np.maximum(np.maximum.reduce(lines), 0.0), 0.0)

    def seconds(self, nbytes: float) -> float:
        """U of one byte count, as a float."""
        return float(self(nbytes))


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||X b - y|| over b >= 0, for a handful of columns: the best unconstrained least
    squares over every subset of columns whose solution is non-negative."""
    k = X.shape[1]
    best, best_err = np.zeros(k), float(np.sum(y**2))
    for size in range(1, k + 1):
        for cols in combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            b = np.zeros(k)
            b[list(cols)] = sol
            err = float(np.sum((X @ b - y) ** 2))
            if err < best_err:
                best, best_err = b, err
    return best


def fit_update_cost(points: Sequence[tuple[float, float]]) -> UpdateCost:
    """The convex piecewise-linear U of (bytes, seconds) ``points`` (see the module doc).

    >>> cost = fit_update_cost([(1e6, 1e-3), (2e6, 2e-3), (4e6, 4e-3)])
    >>> round(cost.seconds(3e6) * 1e3, 6), round(cost.seconds(8e6) * 1e3, 6)
    (3.0, 8.0)
    >>> fit_update_cost([(1e6, 1e-3), (2e6, 3e-3), (3e6, 6e-3)]).seconds(2e6) > 2e-3
    True
    """
    pts = sorted((float(w), float(t)) for w, t in points if w > 0 and t > 0)
    if not pts:
        return UpdateCost()
    w = np.array([p[0] for p in pts])
    t = np.array([p[1] for p in pts])
    if len(np.unique(w)) < 3:  # too few sizes for a curve: the mean rate
        return UpdateCost(((float(np.sum(t) / np.sum(w)), 0.0),))
    scale = float(w.max())
    x = w / scale
    a, q = _nnls(np.column_stack([x, x**2]), t)
    knots = np.unique(np.concatenate([[0.0], x]))
    vals = a * knots + q * knots**2
    pieces = []
    for (x0, v0), (x1, v1) in pairwise(zip(knots, vals)):
        slope = (v1 - v0) / (x1 - x0)
        pieces.append((float(slope / scale), float(v0 - slope * x0)))
    return UpdateCost(tuple(pieces))


def update_cost(profile: Profile, optimizer: str, cluster: Cluster | None = None) -> UpdateCost:
    """U(w) of one ``optimizer`` step: fitted to ``Profile.update_curve`` when measured, else
    ``Profile.update_s`` spread evenly over the model's parameter bytes (free without either).
    A stage pays U of its bytes, shared copies included (each holder updates its copy).

    With ``cluster.data_parallel`` d > 1 the tail gains the data-parallel collectives of
    :mod:`pipeplan.planner.collectives` (each alpha w + beta, on a device of speed v scaled by
    v so that U(w) / v is the whole tail):

        replicate:  AR(w) + U(w)              each piece (s, c) -> (s + a_AR v, c + b_AR v)
        shard:      RS(w) + U(w / d) + AG(w)  each piece (s, c) -> (s / d + (a_RS + a_AG) v,
                                                                     c + (b_RS + b_AG) v)

    The devices must then have one speed."""
    base = _fitted(profile, optimizer)
    if cluster is None or cluster.data_parallel == 1:
        return base
    if not cluster.uniform_speed:
        raise InvalidRequestError(
            "data-parallel replicas need devices of one speed; give every device the same speed"
        )
    v = cluster.devices[0].speed
    pieces = base.pieces or ((0.0, 0.0),)
    if cluster.data_parallel_mode == "shard":
        d = cluster.data_parallel
        (a_rs, b_rs), (a_ag, b_ag) = (
            collective_cost(cluster, "reduce_scatter"),
            collective_cost(cluster, "all_gather"),
        )
        return UpdateCost(
            tuple((s / d + (a_rs + a_ag) * v, c + (b_rs + b_ag) * v) for s, c in pieces)
        )
    alpha, beta = collective_cost(cluster, "all_reduce")
    return UpdateCost(tuple((s + alpha * v, c + beta * v) for s, c in pieces))


def _fitted(profile: Profile, optimizer: str) -> UpdateCost:
    """The fit, once per profile and optimizer (:class:`pipeplan.planner.unitcosts.ProfileTables`)."""
    return tables(profile).memo(("update", optimizer), lambda: _fit(profile, optimizer))


def _fit(profile: Profile, optimizer: str) -> UpdateCost:
    curve = profile.update_curve.get(optimizer)  # type: ignore[call-overload]
    if curve:
        return fit_update_cost(curve)
    total = sum(u.param_bytes for u in profile.units)
    seconds = profile.update_s.get(optimizer)  # type: ignore[call-overload]
    if not seconds or total <= 0:
        return UpdateCost()
    return UpdateCost(((float(seconds) / total, 0.0),))


def update_tail(
    updates: Sequence[float],
    backward: Sequence[float],
    comm: Sequence[float],
    syncs: Sequence[TiedSync] = (),
    kappa_u: float = 0.0,
) -> float:
    """R = max(0, max_j E_j): how long the updates (and tied-gradient all-reduces) outlast
    stage 0's last backward.  ready_j = -D_j, D_j = sum_{i<j} (B_i + C_i / 2) (the last
    micro-batch's gradient crosses every cut before stage j and runs every backward there),
    moved by each all-reduce in turn to the latest arrival among its stages plus its seconds;
    stage j's update (U_j of work) then runs from ready_j and ends at E_j, sharing with the
    other updates under way (:func:`shared_ends`; E_j = ready_j + U_j when ``kappa_u`` = 0)."""
    ready, drain = [], 0.0
    for j in range(len(updates)):
        ready.append(-drain)
        drain += backward[j] + comm[j] / 2
    for sync in syncs:
        end = max(ready[i] for i in sync.stages) + sync.seconds
        for i in sync.stages:
            ready[i] = end
    if not kappa_u:
        return max(0.0, *(r + u for r, u in zip(ready, updates, strict=True)))
    return max(0.0, *shared_ends(ready, updates, kappa_u))


def shared_ends(release: Sequence[float], work: Sequence[float], kappa_u: float) -> list[float]:
    """When each job j, released at ``release[j]`` with ``work[j]`` seconds of work, ends under
    egalitarian processor sharing: while a jobs are under way each progresses at rate
    1 / (1 + kappa_u (a - 1)).  Jobs with no work end at their release and share nothing.

    All jobs under way progress alike, so one virtual time V (the work each has done since
    V = 0) serves them all: job j ends when V reaches V(release_j) + work_j.  Between events (a
    release or an end) V grows linearly; O(p^2) for p jobs.  Two jobs released together end at
    (1 + kappa_u) min + (max - min) = max + kappa_u min.

    >>> [round(e, 9) for e in shared_ends([0.0, 0.0], [2.0, 3.0], 0.5)]
    [3.0, 4.0]
    >>> [round(e, 9) for e in shared_ends([0.0, 5.0], [2.0, 3.0], 0.5)]
    [2.0, 8.0]
    """
    ends = [float(r) for r in release]
    jobs = sorted(
        (float(r), j) for j, (r, w) in enumerate(zip(release, work, strict=True)) if w > 0
    )
    target: dict[int, float] = {}  # V at which each job under way ends
    now = virtual = 0.0
    i = 0
    while i < len(jobs) or target:
        if not target:  # idle until the next release (V restarts, for precision)
            now, virtual = jobs[i][0], 0.0
        while i < len(jobs) and jobs[i][0] <= now:  # release everything due
            target[jobs[i][1]] = virtual + float(work[jobs[i][1]])
            i += 1
        rate = 1.0 / (1.0 + kappa_u * (len(target) - 1))
        first = min(target.values())
        finish = now + max(first - virtual, 0.0) / rate
        if i < len(jobs) and jobs[i][0] < finish:  # a release comes first
            virtual += (jobs[i][0] - now) * rate
            now = jobs[i][0]
            continue
        now, virtual = finish, first
        for j in [j for j, v in target.items() if v <= first]:
            ends[j] = now
            del target[j]
    return ends
