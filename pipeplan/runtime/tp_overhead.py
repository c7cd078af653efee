"""The host cost of torch's tensor parallelism per split projection: a phase of ``pipeplan
calibrate`` on 2+ ranks.

torch's :func:`~torch.distributed.tensor.parallel.parallelize_module` makes every split
projection a DTensor operation: its input wrapped (``from_local``), the sharding propagated,
the output redistributed and unwrapped, in the forward and again in the backward.  On a GPU
that host work hides behind the kernels while they are long; on a CPU rank, or under short
kernels, it is paid in line, and so is the wait at each collective for the rank that arrives
late.  The cost model (:mod:`pipeplan.solvers.tensor_parallel`) charges it as o_tp seconds per
split projection per pass (``Cluster.tp_op_overhead_s``); this module measures it.

The ranks form pairs (a ``(world / 2, 2)`` device mesh; every pair measures at once, as every
tensor-parallel group of a node computes at once).  Each rank times, ``repeats`` times after
one warm-up, a column-wise then row-wise MLP (``Linear(d, 4 d)``, GELU, ``Linear(4 d, d)``
on ``tokens`` x d float32 inputs, Megatron's MLP):

* T_1: forward + backward of the whole MLP, unsplit, on every rank;
* T_2: the same MLP split over the pair (``ColwiseParallel`` then ``RowwiseParallel``, with
  torch's defaults: the forward all-reduces the output, the backward the input's gradient).

Every FLOP of the MLP is split, so the cost model without the host cost charges T_1 / 2 + 2 A,
A the all-reduce of the X = tokens x d x 4 output bytes as it prices one (a ring at t = 2 on
the link ``pipeplan calibrate`` fits, :func:`pipeplan.planner.collectives.ring_cost`).  The
rest, over the 2 projections and 2 passes, is

    o_tp = max(0, (T_2 - T_1 / 2 - 2 A(X)) / 4)

(:func:`tp_overhead`; T the medians over the repeats, the largest over the ranks, as a pair
waits for its slower rank; calibrate takes the median over its launches).  Charged so, the
model reproduces T_2 of the calibration MLP itself.
"""

from __future__ import annotations

import copy
import statistics
import time

from pipeplan.planner.collectives import ring_cost
from pipeplan.planner.types import Link

__all__ = ["TOKENS", "WIDTH", "measure_tp_overhead", "tp_overhead"]

WIDTH = 256
"""d of the calibration MLP: a small layer, whose arithmetic (about 1 ms forward and backward
on one CPU thread) does not drown the host work it measures."""
TOKENS = 256
"""Rows of its input (micro-batch x sequence)."""


def measure_tp_overhead(
    device: str, repeats: int, width: int = WIDTH, tokens: int = TOKENS
) -> dict[str, float]:
    """The module docstring's measurement on this rank's pair: ``{"whole_s": T_1, "split_s":
    T_2, "bytes": X}`` (each time the largest over the ranks), or ``{}`` where the world's
    ranks do not form pairs (one rank, or an odd count).  Every rank of the default process
    group calls it."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    if world < 2 or world % 2:
        return {}
    kind = "cuda" if device.startswith("cuda") else "cpu"
    mesh = init_device_mesh(kind, (world // 2, 2), mesh_dim_names=("pairs", "tp"))["tp"]
    gen = torch.Generator().manual_seed(0)
    whole = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(
        device
    )
    with torch.no_grad():  # the same weights on every rank: the pair splits one MLP
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(device) * 0.02)
    split = parallelize_module(
        copy.deepcopy(whole), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    x = torch.randn(tokens, width, generator=gen).to(device).requires_grad_()

    def sync() -> None:
        if kind == "cuda":
            torch.cuda.synchronize()

    def passes(module: nn.Module) -> float:
        times = []
        for i in range(repeats + 1):
            module.zero_grad(set_to_none=True)
            x.grad = None
            dist.barrier()
            sync()
            start = time.perf_counter()
            out = module(x)
            local = out.to_local() if hasattr(out, "to_local") else out
            local.sum().backward()
            sync()
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    mine = torch.tensor([passes(whole), passes(split)], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {
        "whole_s": float(mine[0]),
        "split_s": float(mine[1]),
        "bytes": float(tokens * width * 4),
    }


def tp_overhead(measured: dict[str, float], link: Link) -> float:
    """o_tp from one measurement (:func:`measure_tp_overhead`) and the link the cost model
    prices the pair's all-reduce on (module docstring); 0 for an empty measurement.

    >>> from pipeplan.planner.types import Link
    >>> m = {"whole_s": 0.012, "split_s": 0.012, "bytes": 262144.0}
    >>> round(tp_overhead(m, Link(bandwidth_Bps=2**30, latency_s=1e-4)) * 1e3, 3)
    1.278
    """
    if not measured:
        return 0.0
    alpha, beta = ring_cost(link, 2, "all_reduce")
    allreduce = alpha * measured["bytes"] + beta
    return max(0.0, (measured["split_s"] - measured["whole_s"] / 2 - 2 * allreduce) / 4)
