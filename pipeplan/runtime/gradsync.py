"""Gradient synchronisation after a pipeline step: what makes a rank's gradients the whole model's.

``pipeplan run`` (:class:`~pipeplan.runtime.engine.PipelineRunner`) and a loop of your own
(``pipeplan.split``'s ``sync_gradients``) call the same three functions, in this order, after
the schedule's step and before the optimizer's:

1. :func:`divide_microbatches` divides every gradient by m where torch's multi-chunk schedules
   left them summed over the micro-batches.  With one chunk per rank torch divides by m itself;
   with v > 1 the runner builds the schedule with ``scale_grads=False``, because torch divides
   per stage, which would divide a weight two chunks of a rank share (a tied embedding and
   head in a V) twice, part way through its sum.
2. :func:`sum_tied` sums each tied parameter's gradient (an embedding and the LM head that
   reuses it, on other ranks) over the ranks holding it, so the copies receive the same
   update and stay equal: one ``all_reduce`` per set of ranks, on a process group of exactly
   those ranks (:func:`tied_groups` makes them).
3. :func:`average_replicas` averages every gradient over the data-parallel replicas of the
   stage, packed into buckets as DDP's.

Each all-reduce takes a single contiguous gradient where it lies (no temporary, as the cost
model assumes) and packs several into one flat buffer, copied back afterwards.  A parameter
without a gradient joins with zeros, so every rank reduces the same sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeplan.runtime.mesh import local
from pipeplan.runtime.stages import TiedParameter

__all__ = ["TiedGroup", "average_replicas", "divide_microbatches", "sum_tied", "tied_groups"]

TiedGroup = tuple[Any, list[nn.Parameter]]
"""A process group of the ranks that hold some tied parameters, and this rank's copies."""

#: The data-parallel gradient buckets' size (DDP's default, 25 MiB).
_BUCKET_BYTES = 25 << 20


def divide_microbatches(params: Sequence[nn.Parameter], microbatches: int) -> None:
    """Divide each gradient of ``params`` by ``microbatches`` (a schedule built with
    ``scale_grads=False`` left them summed over the micro-batches)."""
    for prm in params:
        if prm.grad is not None:
            prm.grad.div_(microbatches)


def tied_groups(
    tied: Sequence[TiedParameter],
    params: Mapping[str, nn.Parameter],
    owner: Sequence[int],
    *,
    rank: int,
    ranks: int,
    replica: int,
    replicas: int,
    tensor_parallel: int = 1,
    tp_rank: int = 0,
) -> list[TiedGroup]:
    """One process group per distinct set of ranks holding ``tied`` parameters (stage s on rank
    ``owner[s]``), for each replica and tensor-parallel index: the groups this rank (position
    ``rank`` of ``ranks``, replica ``replica`` of ``replicas``, tp index ``tp_rank`` of
    ``tensor_parallel``: global rank (replica ranks + rank) tensor_parallel + tp_rank) belongs
    to, with its parameters (``params``: by name).  Collective: every rank creates every
    group."""
    owners: dict[tuple[int, ...], list[TiedParameter]] = {}
    for t in tied:
        owners.setdefault(tuple(sorted({owner[s] for s in t.stages})), []).append(t)
    groups = []
    tp = tensor_parallel
    for held_by, shared in sorted(owners.items()):
        for r in range(replicas):  # every rank creates every replica's group
            for k in range(tp):
                group = dist.new_group([(r * ranks + j) * tp + k for j in held_by])
                if r == replica and k == tp_rank and rank in held_by:
                    groups.append((group, [params[t.name] for t in shared]))
    return groups


def sum_tied(groups: Sequence[TiedGroup]) -> None:
    """Sum each tied parameter's gradient over the ranks holding it, in place: one all-reduce
    per group of ranks."""
    for group, params in groups:
        _all_reduce(_gradients(params), group)


def average_replicas(params: Sequence[nn.Parameter], group: Any, replicas: int) -> None:
    """Average every gradient of ``params`` over the ``replicas`` data-parallel replicas of
    this stage (``group``): gradients packed into buckets of about ``_BUCKET_BYTES`` (as
    DDP's), one all-reduce per bucket, then / d, copied back.  One call per parameter cost
    gloo about 1 ms each (69 ms for the bundled GPT's 50 parameters, against 1.5 ms of bytes);
    a bucket is the only temporary, at most ``_BUCKET_BYTES``."""
    bucket: list[Tensor] = []
    size = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        bucket.append(local(p.grad))  # a tensor-parallel gradient: this rank's shard
        size += bucket[-1].numel() * bucket[-1].element_size()
        if size >= _BUCKET_BYTES:
            _all_reduce(bucket, group, replicas)
            bucket, size = [], 0
    if bucket:
        _all_reduce(bucket, group, replicas)


def _gradients(params: Sequence[nn.Parameter]) -> list[Tensor]:
    """Each parameter's gradient, zeros made where it has none."""
    grads: list[Tensor] = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local(p.grad))  # a sharded (FSDP2) gradient: this rank's shard
    return grads


def _all_reduce(grads: list[Tensor], group: Any, divide: int | None = None) -> None:
    """Sum ``grads`` over ``group`` in place, then divide them by ``divide`` (if given)."""
    if len(grads) == 1 and grads[0].is_contiguous():
        dist.all_reduce(grads[0], op=dist.ReduceOp.SUM, group=group)
        if divide is not None:
            grads[0].div_(divide)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if divide is not None:
        flat.div_(divide)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
