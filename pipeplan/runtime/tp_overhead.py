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
one warm-up, the two runs compared interleaved pass by pass, a column-wise then row-wise MLP
(``Linear(d, 4 d)``, GELU, ``Linear(4 d, d)`` on ``tokens`` x d float32 inputs, Megatron's
MLP):

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

Sequence parallelism adds its own host work: each of its collectives
(:class:`pipeplan.intake.tp_sequence.SequenceComm`) is a Python autograd function and a gloo
or nccl call.  Per row-wise projection it adds a gather in the forward (the column-wise
projection's input) and, in the backward, the all-gather of the reduce-scattered output's
gradient and the norm weights' all-reduce.  The pair times a pre-norm block, x + fc2(gelu(fc1(
LayerNorm(x)))) on 1 x ``tokens`` x d, split by the runtime's own rewrite
(:func:`pipeplan.intake.tp_stages.split_stage_body`) without (T_b) and with (T_s) the
sequence's split, the block receiving its share of the sequence as a stage does.  The model
charges the split the all-gather AG(X) in the backward beyond T_b; the rest, over the three
collectives, is

    o_sp = max(0, (T_s - T_b - AG(X)) / 3)

(:func:`sequence_overhead`), charged per row-wise projection once in the forward and twice
in the backward (``Cluster.tp_sequence_overhead_s``).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import TYPE_CHECKING, Any

from pipeplan.intake.tp_layout import Style
from pipeplan.planner.collectives import ring_cost
from pipeplan.planner.types import Link

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["TOKENS", "WIDTH", "measure_tp_overhead", "sequence_overhead", "tp_overhead"]

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

    def one(module: nn.Module, x: Tensor) -> float:
        """Seconds of one forward and backward, started together on the pair."""
        module.zero_grad(set_to_none=True)
        x.grad = None
        dist.barrier()
        sync()
        start = time.perf_counter()
        out = module(x)
        local = out.to_local() if hasattr(out, "to_local") else out
        local.sum().backward()
        sync()
        return time.perf_counter() - start

    def passes(*runs: tuple[nn.Module, Tensor]) -> list[float]:
        """The median of ``repeats`` passes of each, after one warm-up, interleaved."""
        times: list[list[float]] = [[] for _ in runs]
        for i in range(repeats + 1):
            for got, run in zip(times, runs, strict=True):
                elapsed = one(*run)
                if i:
                    got.append(elapsed)
        return [statistics.median(t) for t in times]

    whole_s, split_s = passes((whole, x), (split, x))
    block_s, sequence_s = passes(*_sequence_blocks(mesh, width, tokens, device))
    mine = torch.tensor([whole_s, split_s, block_s, sequence_s], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {
        "whole_s": float(mine[0]),
        "split_s": float(mine[1]),
        "block_s": float(mine[2]),
        "sequence_s": float(mine[3]),
        "bytes": float(tokens * width * 4),
    }


def _sequence_blocks(
    mesh: Any, width: int, tokens: int, device: str
) -> tuple[tuple[nn.Module, Tensor], tuple[nn.Module, Tensor]]:
    """The pre-norm block of the module docstring split by the runtime's rewrite without and
    with the sequence's split, each with the input it runs on (the whole sequence; this rank's
    share of it)."""
    import torch
    from torch import nn
    from torch.fx import symbolic_trace

    from pipeplan.intake.tp_sequence import SequenceRole
    from pipeplan.intake.tp_stages import split_stage_body

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x: Tensor) -> Tensor:
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

    torch.manual_seed(0)  # the same block on every rank
    block = Block().to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, width, generator=gen).to(device)
    styles: dict[str, Style] = {"fc1": "colwise", "fc2": "rowwise"}
    plain = symbolic_trace(copy.deepcopy(block))
    split_stage_body(plain, styles, mesh, [x])
    seq = symbolic_trace(copy.deepcopy(block))
    split_stage_body(seq, styles, mesh, [x], SequenceRole(width, (True,), False))
    rank, t = mesh.get_local_rank(), mesh.size()
    share = x[:, rank * tokens // t : (rank + 1) * tokens // t]
    return (plain, x.requires_grad_()), (seq, share.detach().requires_grad_())


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


def sequence_overhead(measured: dict[str, float], link: Link) -> float:
    """o_sp from one measurement (:func:`measure_tp_overhead`) and the link the cost model
    prices the pair's all-gather on (module docstring); 0 where it was not measured.

    >>> from pipeplan.planner.types import Link
    >>> m = {"block_s": 0.012, "sequence_s": 0.015, "bytes": 262144.0}
    >>> round(sequence_overhead(m, Link(bandwidth_Bps=2**30, latency_s=1e-4)) * 1e3, 3)
    0.926
    """
    if "sequence_s" not in measured:
        return 0.0
    alpha, beta = ring_cost(link, 2, "all_gather")
    gather = alpha * measured["bytes"] + beta
    return max(0.0, (measured["sequence_s"] - measured["block_s"] - gather) / 3)
