"""Recompute flags that make a partition fit its devices' memory: the schedule solver's fits.

For a partition of p v chunks (:class:`~pipeplan.solvers.chunks.ChunkPlan`) with no chunk
recomputing, some ranks' peaks (:func:`~pipeplan.planner.replay.peak_memory`) may exceed their
devices.  A chunk's costs depend on its own flag only, and a rank's peak on its own chunks
only, so each rank over its memory is fitted alone, two ways:

* **largest first**: its chunks recompute in the order of their held bytes, largest first,
  until it fits (the fewest flips, whatever each costs);
* **least work**: among the 2**v - 1 sets of its chunks, one that fits it and adds the least
  work per micro-batch (F + B, or F + I + W in the split families, recomputing less
  keeping), ties to fewer chunks.

Either recomputes all of the rank's chunks where nothing fits.  Neither is always the faster
replay (the step is a longest path, not a sum of work), so the solver's refit search scores
both (:mod:`pipeplan.solvers.multichunk`, step 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np

from pipeplan.planner.replay import ChunkCosts, peak_memory
from pipeplan.solvers.chunks import ChunkPlan, fixed_flags

__all__ = ["Fitted", "fits", "largest_first", "recompute_to_fit"]


def recompute_to_fit(cp: ChunkPlan, starts: Sequence[int]) -> list[bool]:
    """No chunk recomputes; then each rank over its memory recomputes the set of its chunks
    that fits it with the least added work (:func:`fits`).  A fixed policy's flags as they
    are."""
    return fits(cp, starts, least=True)[0][0]


Fitted = tuple[list[bool], ChunkCosts, tuple[int, ...]]
"""Recompute flags, with the chunk costs and the peaks they give."""


def fits(cp: ChunkPlan, starts: Sequence[int], least: bool = True) -> list[Fitted]:
    """The flags that make every rank fit, where it can: nothing recomputes where no rank is
    over its memory, the policy's where it fixes them; else the fit "least work" and, where it
    differs, "largest first" (only the latter without ``least``: steps 1 and 3 of
    :mod:`pipeplan.solvers.multichunk`).

    A chunk's costs depend on its own flag only, and a rank's peak on its own chunks only, so
    each rank over its memory is fitted alone: (least work) among the 2**v - 1 sets of its
    chunks, the first that fits in the order of the work recomputing them adds (per
    micro-batch, F + B or F + I + W, recomputing less keeping; ties to fewer chunks); (largest
    first) its chunks in the order of their held bytes, largest first, until it fits.  Either
    recomputes all of the rank's chunks where nothing fits."""
    k, v = len(starts), cp.v
    fixed = fixed_flags(cp.options, k)
    if fixed is not None:
        costs = cp.costs_of(starts, fixed)
        return [(fixed, costs, peak_memory(cp.family, cp.p, v, cp.m, costs))]
    keep = cp.costs_of(starts, [False] * k)
    peaks = peak_memory(cp.family, cp.p, v, cp.m, keep)
    limits = [d.memory_bytes for d in cp.cluster.devices]
    over = [q for q, pk in enumerate(peaks) if pk > limits[q]]
    if not over:
        return [([False] * k, keep, peaks)]
    largest = largest_first(cp, starts, over)
    if not least:
        return [largest]
    redo = cp.costs_of(starts, [True] * k)
    extra = np.asarray(_work(redo)) - np.asarray(_work(keep))
    # bit b of a mask j: the b-th chunk of every rank recomputes; one walk gives every rank's
    # peak under it, since a rank's peak moves with its own chunks only
    mine = [[s for s in range(k) if cp.owner[s] == q] for q in range(cp.p)]
    bit = [0] * k
    for chunks in mine:
        for b, s in enumerate(chunks):
            bit[s] = b
    walks = [peaks] + [
        peak_memory(cp.family, cp.p, v, cp.m,
                    _mixed(keep, redo, [bool(j >> bit[s] & 1) for s in range(k)], _MEMORY))
        for j in range(1, 2**v)
    ]  # fmt: skip
    rc = [False] * k
    for q in over:
        sets = [[s for s in mine[q] if j >> bit[s] & 1] for j in range(2**v)]
        fit = [j for j in range(1, 2**v) if walks[j][q] <= limits[q]]
        cheapest = min(
            fit, key=lambda j: (float(extra[sets[j]].sum()), len(sets[j]), sets[j]),
            default=2**v - 1,
        )  # fmt: skip
        for s in sets[cheapest]:
            rc[s] = True
    if rc == largest[0]:
        return [largest]
    costs = _mixed(keep, redo, rc)
    return [(rc, costs, peak_memory(cp.family, cp.p, v, cp.m, costs)), largest]


def largest_first(cp: ChunkPlan, starts: Sequence[int], over: Sequence[int]) -> Fitted:
    """:func:`fits`' "largest first": while a rank of ``over`` is over its memory, its
    chunk with the most held bytes recomputes (until all of that rank's do)."""
    rc = [False] * len(starts)
    over = list(over)
    while True:
        costs = cp.costs_of(starts, rc)
        peaks = peak_memory(cp.family, cp.p, cp.v, cp.m, costs)
        over = [q for q in over if peaks[q] > cp.cluster.devices[q].memory_bytes]
        flip = [s for s in range(len(starts)) if cp.owner[s] in over and not rc[s]]
        if not flip:
            return rc, costs, peaks
        rc[max(flip, key=lambda s: costs.held_bytes[s])] = True


def _work(costs: ChunkCosts) -> list[float]:
    """Each chunk's compute per micro-batch: F + B, or F + I + W in the split families."""
    if costs.backward_input_s is not None and costs.backward_weight_s is not None:
        back = [i + w for i, w in zip(costs.backward_input_s, costs.backward_weight_s, strict=True)]
    else:
        back = list(costs.backward_s)
    return [f + b for f, b in zip(costs.forward_s, back, strict=True)]


#: The fields of :class:`ChunkCosts` that :func:`peak_memory` reads.
_MEMORY = (
    "static_bytes", "held_bytes", "weight_held_bytes", "transient_bytes", "grad_bytes",
    "grad_temp_bytes", "grad_temp_first_bytes",
)  # fmt: skip


def _mixed(
    keep: ChunkCosts, redo: ChunkCosts, rc: Sequence[bool], names: Sequence[str] | None = None
) -> ChunkCosts:
    """Chunk s's costs from ``redo`` where ``rc[s]``, else from ``keep`` (only the fields
    ``names`` mixed, the others ``keep``'s, when given)."""

    def pick(a: Sequence[Any] | None, b: Sequence[Any] | None) -> list[Any] | None:
        if a is None or b is None:
            return None
        if not a:
            return []
        return [y if f else x for x, y, f in zip(a, b, rc, strict=True)]

    names = names or [f.name for f in fields(ChunkCosts)]
    mixed: dict[str, Any] = {f: pick(getattr(keep, f), getattr(redo, f)) for f in names}
    return replace(keep, **mixed)
