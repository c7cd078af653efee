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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations, pairwise

import numpy as np

from planner.types import Profile

__all__ = ["UpdateCost", "fit_update_cost", "update_cost"]


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


def update_cost(profile: Profile, optimizer: str) -> UpdateCost:
    """U(w) of one ``optimizer`` step: fitted to ``Profile.update_curve`` when measured, else
    ``Profile.update_s`` spread evenly over the model's parameter bytes (free without either).
    A stage pays U of its bytes, shared copies included (each holder updates its copy)."""
    curve = profile.update_curve.get(optimizer)  # type: ignore[call-overload]
    if curve:
        return fit_update_cost(curve)
    total = sum(u.param_bytes for u in profile.units)
    seconds = profile.update_s.get(optimizer)  # type: ignore[call-overload]
    if not seconds or total <= 0:
        return UpdateCost()
    return UpdateCost(((float(seconds) / total, 0.0),))
