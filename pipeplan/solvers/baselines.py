"""The partitions people use today, evaluated under pipeplan's cost model.

Each baseline maps (Profile, Cluster, PlanOptions) to a :class:`pipeplan.planner.types.Plan` built by
:func:`pipeplan.planner.evaluate.evaluate` with ``solver`` set to the baseline's name and status
``"heuristic"`` (``"infeasible"`` when a stage does not fit its device: baselines never raise
for memory, so that a comparison can show how they fail).

``uniform``
    Equal numbers of units per stage (the first ``n mod p`` stages get one more), the default of
    Megatron-LM and torchtitan's pipeline splitting.  O(p).

``params``
    Balance parameter bytes: the contiguous partition minimising the largest stage's w_j, as
    DeepSpeed's ``partition_method="parameters"`` (``ds_utils.partition_balanced``, a bisection
    on the bottleneck with a greedy check).  O(n + p log n log W).

``torchgpipe``
    torchgpipe's ``balance_by_time``: per-unit forward + backward times f_u + g_u, normalised
    to [0, 1] by (x - min) / (max - min), split by the block-partition algorithm of Bárány and
    Grinberg, "Block partitions of sequences" (Israel J. Math. 206, 2015; arXiv:1308.2452), as
    implemented in torchgpipe/balance/blockpartition.py.  Starting from equal-count blocks:

        (1) fix a maximal block B_p;
        (2) if M(P) <= m(P) + 1 stop (M, m = largest and smallest block sums);
        (3) else take a minimal block B_q and the block B_h next to it on the side of B_p;
            move B_h's element nearest to B_q into B_q; go to (1) if h = p, else to (2).

    The paper takes the minimal block closest to B_p; torchgpipe takes the first one, and so
    do we, to reproduce what torchgpipe users get (with a guard that keeps blocks non-empty).

    The result satisfies M(P) <= m(P) + 1 <= OPT + 1 in normalised units (every element is at
    most 1); it is not the min-max optimum.  Memory, recomputation and communication are
    ignored, as in torchgpipe.  O(p n^2) moves in the worst case, each O(p) here.

The micro-batch count is ``options.microbatches`` when given, else the DP's choice
(:func:`pipeplan.solvers.dp.partition_dp`), or the largest profiled count when the DP finds nothing
feasible or cannot model the request.  Baselines cannot honour pinned units or per-stage unit
counts and refuse them with :class:`UnsupportedConstraintError`; allowed cuts
(``PlanOptions.allowed_cuts``) they keep to by splitting the runs of units between them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise

import numpy as np

from pipeplan.planner.errors import UnsupportedConstraintError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.planner.unitcosts import unit_costs
from pipeplan.solvers.request import ResolvedRequest, resolve_request

__all__ = [
    "baseline_microbatches",
    "block_partition",
    "minmax_partition",
    "solve_params",
    "solve_torchgpipe",
    "solve_uniform",
    "uniform_partition",
]


def uniform_partition(n: int, p: int) -> list[int]:
    """Stage starts of n units in p stages whose sizes differ by at most one.

    >>> uniform_partition(10, 4)
    [0, 3, 6, 8]
    """
    size, extra = divmod(n, p)
    starts, at = [], 0
    for j in range(p):
        starts.append(at)
        at += size + (j < extra)
    return starts


def _greedy(prefix: np.ndarray, p: int, limit: float) -> list[int] | None:
    """Starts when each block takes the most elements with sum <= limit (non-empty blocks)."""
    n = len(prefix) - 1
    starts = [0]
    for j in range(p - 1):
        reach = int(np.searchsorted(prefix, prefix[starts[-1]] + limit, side="right")) - 1
        nxt = min(reach, n - (p - 1 - j))
        if nxt <= starts[-1]:
            return None
        starts.append(nxt)
    return starts if prefix[n] - prefix[starts[-1]] <= limit else None


def minmax_partition(weights: Sequence[float], p: int) -> list[int]:
    """Stage starts of the contiguous partition with the smallest largest block sum.

    Exact up to float resolution: the greedy check (each block takes the most elements that fit
    the limit) is monotone in the limit, so bisection converges to the optimal bottleneck.

    >>> minmax_partition([1, 1, 1, 5, 1, 1], 3)
    [0, 3, 4]
    """
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0):
        raise ValueError(f"weights must be non-negative (got min {w.min()})")
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    n = len(w)
    lo, hi = float(w.max(initial=0.0)), float(prefix[-1])
    if _greedy(prefix, p, lo) is not None:
        return _greedy(prefix, p, lo)  # type: ignore[return-value]
    for _ in range(200):  # float bisection: converges to the smallest feasible limit
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if _greedy(prefix, p, mid) is None:
            lo = mid
        else:
            hi = mid
    starts = _greedy(prefix, p, hi)
    assert starts is not None and len(starts) == p <= n
    return starts


def block_partition(sequence: Sequence[float], p: int) -> list[int]:
    """Stage starts by Bárány and Grinberg's block partition (torchgpipe's balance_by_time).

    >>> block_partition([1, 1, 1, 1, 8, 1, 1, 1], 2)
    [0, 4]
    """
    n = len(sequence)
    if not 1 <= p <= n:
        raise ValueError(f"cannot split {n} elements into {p} non-empty blocks")
    lo, span = min(sequence), max(sequence) - min(sequence)
    x = [0.0] * n if span == 0 else [(v - lo) / span for v in sequence]
    prefix = np.concatenate([[0.0], np.cumsum(x)])
    ends = [n // p * (i + 1) for i in range(p - 1)] + [n]  # block i is [ends[i-1], ends[i])

    def size(i: int) -> float:
        return float(prefix[ends[i]] - prefix[ends[i - 1] if i else 0])

    for _ in range(p * n * n + 1):  # the paper's bound on the number of moves
        big = max(range(p), key=lambda i: (size(i), i))  # (1)
        while True:
            sizes = [size(i) for i in range(p)]
            small = min(sizes)
            if sizes[big] <= small + 1:  # (2)
                return _nonempty([0, *ends[:-1]], n)
            q = sizes.index(small)
            if big < q:  # (3) move B_{q-1}'s last element into B_q
                h = q - 1
                ends[h] -= 1
            else:  # move B_{q+1}'s first element into B_q
                h = q + 1
                ends[q] += 1
            if h == big:
                break
    return _nonempty([0, *ends[:-1]], n)  # pragma: no cover - the move bound was reached


def _nonempty(starts: list[int], n: int) -> list[int]:
    """Shift starts minimally so that every block has at least one element."""
    p = len(starts)
    for j in range(1, p):
        starts[j] = max(starts[j], starts[j - 1] + 1)
    for j in range(p - 1, 0, -1):
        starts[j] = min(starts[j], n - (p - j), starts[j + 1] - 1 if j + 1 < p else n - 1)
    return starts


def baseline_microbatches(request: ResolvedRequest) -> int:
    """m for a baseline: the user's, else the DP's choice, else the largest profiled count."""
    if request.options.microbatches is not None:
        return request.options.microbatches
    from pipeplan.solvers.dp import partition_dp

    try:
        found = partition_dp(request.profile, request.cluster, request.options)
    except UnsupportedConstraintError:
        found = None
    return found[1] if found is not None else max(request.microbatches)


def _baseline(
    name: str,
    weights: Callable[[Profile, int], list[float]],
    split: Callable[[Sequence[float], int], list[int]],
) -> Callable[[Profile, Cluster, PlanOptions | None], Plan]:
    """A baseline that ``split``s per-unit ``weights`` (at m micro-batches) into stages.  With
    ``allowed_cuts`` (a target framework's cuts) it splits the runs of units between them,
    each weighing its units' sum, as the framework's own splitter sees its layers."""

    def solve(profile: Profile, cluster: Cluster, options: PlanOptions | None = None) -> Plan:
        options = options or PlanOptions()
        if options.pinned or options.min_units > 1 or options.max_units is not None:
            raise UnsupportedConstraintError(
                f"the {name} baseline cannot pin units or bound units per stage; use --solver cpsat"
            )
        m = baseline_microbatches(resolve_request(profile, cluster, options))
        n, w = profile.n_units, weights(profile, m)
        firsts = [0, *(range(1, n) if options.allowed_cuts is None else options.allowed_cuts)]
        runs = [float(sum(w[a:b])) for a, b in pairwise([*firsts, n])]
        starts = [firsts[g] for g in split(runs, cluster.n_stages)]
        return evaluate(profile, cluster, options, starts[1:], m, solver=name, status="heuristic")

    solve.__name__ = f"solve_{name}"
    solve.__doc__ = f"The {name} baseline's plan (see :mod:`pipeplan.solvers.baselines`)."
    return solve


def _by_time(profile: Profile, m: int) -> list[float]:
    c = unit_costs(profile, m)
    return [float(x) for x in c.f + c.g]


solve_uniform = _baseline(
    "uniform", lambda prof, m: [1.0] * prof.n_units, lambda w, p: uniform_partition(len(w), p)
)
solve_params = _baseline(
    "params", lambda prof, m: [float(u.param_bytes) for u in prof.units], minmax_partition
)
solve_torchgpipe = _baseline("torchgpipe", _by_time, block_partition)
