"""Optimizer-update contention for ``pipeplan calibrate``: Adam steps alone and side by side.

Ranks 0 and 1 time an Adam step (:func:`pipeplan.planner.optim.make_optimizer`) over the same
parameters (``UPDATE_TENSORS`` tensors of ``UPDATE_BYTES`` of float32 in all, fresh random
gradients each time) in three modes, interleaved over ``repeats`` rounds, each after a barrier:
rank 0 alone (the others wait at the next barrier), rank 1 alone, both at once.  Before every
timed step each rank writes through ``FLUSH_BYTES`` (64 MiB), so the cache is as cold as after
a backward (on CUDA the step is timed between synchronisations, with no flush).  Updates that
run at once slow each other by egalitarian processor sharing (:mod:`pipeplan.planner.costmodel`): two of
the same length that start together both take (1 + kappa_u) times as long, so

    kappa_u = median(both) / median(alone) - 1            (:func:`update_contention`)

per rank; the launch keeps the mean over ranks 0 and 1, clamped at 0
(:func:`measure_update_contention`, ``Cluster.update_contention``).

Only :func:`measure_update_contention` and its timing loop, which run on the ranks, import torch
(and :mod:`pipeplan.planner.optim`); :func:`update_contention` is plain arithmetic.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from pipeplan.planner.errors import InvalidRequestError

__all__ = [
    "FLUSH_BYTES",
    "UPDATE_BYTES",
    "UPDATE_TENSORS",
    "measure_update_contention",
    "update_contention",
]


#: The update-contention measurement: parameter tensors and their bytes in all (float32).
UPDATE_TENSORS, UPDATE_BYTES = 8, 8 * 2**20
#: Bytes written before every timed update, to evict the cache as a backward does.
FLUSH_BYTES = 64 * 2**20


def update_contention(alone: Sequence[float], both: Sequence[float]) -> float:
    """kappa_u of one rank: median(both) / median(alone) - 1, from its update's seconds alone
    and beside another rank's update of the same length (negative when the pair ran faster:
    the caller averages ranks, then clamps).

    >>> round(update_contention([0.010, 0.011, 0.009], [0.012, 0.013, 0.030]), 6)
    0.3
    """
    if not alone or not both:
        raise InvalidRequestError("the update contention needs times alone and together")
    return float(statistics.median(both) / statistics.median(alone) - 1.0)


def _update_times(repeats: int, device: str) -> tuple[list[float], list[float]]:
    """(alone, both): this rank's Adam step seconds alone and beside rank 1 - rank's, per round
    after two warm-up rounds (both empty on ranks >= 2, which only keep the barriers)."""
    import torch
    import torch.distributed as dist

    from pipeplan.planner.optim import make_optimizer

    rank = dist.get_rank()
    numel = UPDATE_BYTES // 4 // UPDATE_TENSORS
    params = [torch.randn(numel, device=device, requires_grad=True) for _ in range(UPDATE_TENSORS)]
    for param in params:
        param.grad = torch.randn_like(param)
    opt = make_optimizer("adam", params, 1e-3)
    cuda = device != "cpu"
    junk = None if cuda else torch.zeros(FLUSH_BYTES // 4)
    alone: list[float] = []
    both: list[float] = []
    for i in range(repeats + 2):
        for mode in (0, 1, 2):  # rank 0 alone, rank 1 alone, both at once
            runs = rank == mode or (mode == 2 and rank < 2)
            if runs:
                for param in params:
                    assert param.grad is not None
                    param.grad.normal_()
                if junk is not None:
                    junk.add_(1.0)  # evict the cache, as a backward does
                if cuda:
                    torch.cuda.synchronize()
            dist.barrier()
            if not runs:
                continue
            t0 = time.perf_counter()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:  # warm-up: the optimizer's state is allocated on the first step
                (both if mode == 2 else alone).append(time.perf_counter() - t0)
    dist.barrier()
    return alone, both


def measure_update_contention(repeats: int, device: str) -> float:
    """kappa_u of this launch: the mean of ranks 0 and 1's :func:`update_contention`, >= 0."""
    import torch
    import torch.distributed as dist

    alone, both = _update_times(repeats, device)
    own = update_contention(alone, both) if alone else 0.0
    total = torch.tensor([own], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # ranks >= 2 add 0
    return max(float(total.item()) / 2, 0.0)
