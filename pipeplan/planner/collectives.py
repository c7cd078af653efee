"""The data-parallel axis: what a stage's training state costs in time and memory over d ranks.

A stage (or chunk) of a pipeline is run by d data-parallel ranks, each taking 1 / d of the
global batch.  Two modes (``Cluster.data_parallel_mode``):

``replicate``
    every rank holds the whole stage: parameters w, gradients w and optimizer states s w
    (``OPTIMIZER_STATES``: s = 2 for Adam).  After its last backward the stage all-reduces its
    gradients over the d ranks, then updates all w.

``shard``
    FSDP2 as torchtitan composes it with pipelining (``fully_shard`` on each block and on the
    stage's module, ``reshard_after_forward=False`` when pipelining, torchtitan's default).
    torch's pipelining stages (``torch.distributed.pipelining.stage``) turn gradient
    synchronisation and resharding off for every backward but the step's last
    (``backward_maybe_with_nosync``) and run FSDP's post-backward once, in the
    ``REDUCE_GRAD`` action after the last backward (``perform_reduce_grad``).  So, per stage:

    * the first forward all-gathers the parameters, which then stay unsharded until the
      step's reduction: w unsharded beside the w / d shard;
    * gradients accumulate unsharded (w) over the micro-batches, and are reduce-scattered to
      w / d once, after the last backward (after the last W for the zero-bubble families);
    * the optimizer holds states for its shard (s w / d) and updates w / d bytes.

The collectives over d ranks (ring algorithms on the replicas' link, bandwidth b, per-message
cost a = latency + overhead; Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH", 2005), for w bytes:

    all-reduce       2 (d - 1) / d  w / b  +  2 (d - 1) a
    reduce-scatter     (d - 1) / d  w / b  +    (d - 1) a
    all-gather         (d - 1) / d  w / b  +    (d - 1) a

``pipeplan calibrate`` measures the three on the ranks it has (``Cluster.collectives``); a
measured collective is used as measured, rescaled to d ranks by the ring's (d - 1) / d.

The step pays, per stage, after its last backward (the update tail of
:mod:`pipeplan.planner.updates`, each term affine in w):

    replicate:  AR(w) + U(w)
    shard:      RS(w) + U(w / d) + AG(w)

where the all-gather is charged at the step's end as the next step's first forward's: exact for
stage 0, whose first forward waits for it, and an upper bound for a later stage, whose input
arrives only after the stages before it have computed (FSDP2's prefetch of the next block's
all-gather is overlap this leaves uncounted).

Memory at the stage's peak, per byte of the stage's parameters (:func:`state_factors`):

    replicate:  params 1,           grads 1,  optimizer s
    shard:      params 1 / d + 1,   grads 1,  optimizer s / d

and, sharded, the step's reduction can set a later peak: FSDP2's ``post_backward`` (torch
2.13) frees the unsharded parameters, copies the unsharded gradients into one flat input
(w), frees them, and reduce-scatters into an output (w / d), so the stage then holds

    1 / d + max(2,  1 + 1 / d + g)     per parameter byte, beside s / d and the buffers,

g = 1 on gloo, whose reduce-scatter is an all-reduce of the whole input with a full-size
temporary (measured: an MLP stage of w = 32 MiB over d = 2 peaked at 128.8 MiB, this form
128.5), 0 on nccl, where it never exceeds the backward's peak.  The activations are all gone
by then, so it sets the peak of a stage whose w / d exceeds its activations (a
parameter-heavy stage, :func:`pipeplan.planner.costmodel.memory_parts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeplan.planner.types import OPTIMIZER_STATES, Cluster, Link

__all__ = [
    "COLLECTIVES",
    "Collective",
    "StateFactors",
    "collective_cost",
    "ring_cost",
    "state_factors",
]

Collective = Literal["all_reduce", "reduce_scatter", "all_gather"]

COLLECTIVES: tuple[Collective, ...] = ("all_reduce", "reduce_scatter", "all_gather")

#: Each collective's share of the ring's steps: all-reduce sends 2 (d - 1) chunks of w / d,
#: reduce-scatter and all-gather (d - 1).
_RING_STEPS: dict[str, float] = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


@dataclass(frozen=True, slots=True)
class StateFactors:
    """Bytes held at a stage's peak per byte of its parameters, by kind."""

    params: float
    grads: float
    optimizer: float
    shard: float = 0.0
    """1 / d where FSDP shards the stage over d ranks, else 0: the share each rank keeps."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def state_factors(optimizer: str, cluster: Cluster) -> StateFactors:
    """The training state a rank holds per parameter byte of its stage (module docstring).

    >>> from pipeplan.planner.types import Cluster
    >>> c = Cluster.homogeneous(2, 2**30)
    >>> state_factors("adam", c)
    StateFactors(params=1.0, grads=1.0, optimizer=2.0, shard=0.0)
    >>> state_factors("adam", c.model_copy(update={"data_parallel": 4,
    ...                                            "data_parallel_mode": "shard"}))
    StateFactors(params=1.25, grads=1.0, optimizer=0.5, shard=0.25)
    """
    s = float(OPTIMIZER_STATES[optimizer])
    d = cluster.data_parallel
    if cluster.data_parallel_mode == "shard" and d > 1:
        return StateFactors(params=1.0 + 1.0 / d, grads=1.0, optimizer=s / d, shard=1.0 / d)
    return StateFactors(params=1.0, grads=1.0, optimizer=s)


def ring_cost(link: Link, ranks: int, kind: Collective) -> tuple[float, float]:
    """(alpha, beta): ``kind`` of w > 0 bytes as a ring over ``ranks`` ranks on ``link`` takes
    alpha w + beta seconds (the module docstring's formulas, d = ``ranks``); (0, 0) for one
    rank.  The data-parallel axis (:func:`collective_cost`) and the tensor-parallel one
    (:mod:`pipeplan.solvers.tensor_parallel`) both price their rings here.

    >>> from pipeplan.planner.types import Link
    >>> a, b = ring_cost(Link(bandwidth_Bps=1e9, latency_s=1e-6), 4, "all_reduce")
    >>> round(a * 1e9, 3), round(b * 1e6, 3)
    (1.5, 6.0)
    """
    if ranks <= 1:
        return 0.0, 0.0
    steps = _RING_STEPS[kind]
    bw = link.bandwidth_Bps
    alpha = 0.0 if bw is None else steps * (ranks - 1) / ranks / bw
    return alpha, steps * (ranks - 1) * (link.latency_s + link.overhead_s)


def collective_cost(cluster: Cluster, kind: Collective) -> tuple[float, float]:
    """(alpha, beta): ``kind`` of w > 0 bytes over the cluster's d data-parallel ranks takes
    alpha w + beta seconds; (0, 0) for one rank.

    A measured collective (``Cluster.collectives[kind]``: an affine fit (seconds per byte,
    seconds) at ``Cluster.collective_ranks`` ranks) is rescaled to d by the ring's
    (d - 1) / d per byte and (d - 1) per message; otherwise the ring on ``replica_link``
    (module docstring).

    >>> from pipeplan.planner.types import Cluster, Link
    >>> c = Cluster.homogeneous(2, 2**30, link=Link(bandwidth_Bps=1e9)).model_copy(
    ...     update={"data_parallel": 4})
    >>> [round(a * 1e9, 3) for a, _ in (collective_cost(c, k) for k in COLLECTIVES)]
    [1.5, 0.75, 0.75]
    """
    d = cluster.data_parallel
    if d == 1:
        return 0.0, 0.0
    measured = cluster.collectives.get(kind)
    if measured is not None:
        n = cluster.collective_ranks
        per_byte, fixed = measured
        return per_byte * ((d - 1) / d) / ((n - 1) / n), fixed * (d - 1) / (n - 1)
    return ring_cost(cluster.replica_link or cluster.link, d, kind)
