"""The devices a plan runs on and the links between them (``pipeplan calibrate`` measures them)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field, model_validator

from pipeplan.planner.types.base import (
    CLUSTER_SCHEMA,
    FrozenModel,
)

__all__ = ["Cluster", "Device", "Link"]


class Device(FrozenModel):
    name: str
    memory_bytes: int = Field(gt=0)
    speed: float = Field(default=1.0, gt=0)
    """Relative speed: unit times measured on the profiling device are divided by it."""


class Link(FrozenModel):
    """Point-to-point link between neighbouring stages.

    A cut whose k tensors hold s bytes in all takes, one way,
    ``k * (latency_s + overhead_s) + s / bandwidth_Bps`` seconds; with measured ``samples`` the
    first two terms are replaced by ``k * (one_way(s / k) + overhead_s)``, ``one_way``
    interpolating the samples piecewise-linearly (and extrapolating with the bandwidth past the
    largest).
    """

    bandwidth_Bps: float | None = Field(default=None, gt=0)
    """Bytes per second; ``None`` means transfers are free (the default when not calibrated)."""
    latency_s: float = Field(default=0.0, ge=0)
    overhead_s: float = Field(default=0.0, ge=0)
    """Fixed per-message software cost (measured by ``pipeplan calibrate``)."""
    samples: tuple[tuple[int, float], ...] = ()
    """Measured (bytes, one-way seconds) pairs, ascending in bytes (``pipeplan calibrate``)."""

    @model_validator(mode="after")
    def _check_samples(self) -> Link:
        sizes = [s for s, _ in self.samples]
        if sizes != sorted(set(sizes)) or any(t < 0 for _, t in self.samples):
            raise ValueError("samples must be ascending (bytes, seconds >= 0) pairs")
        return self

    def one_way_s(self, nbytes: np.ndarray, messages: np.ndarray) -> np.ndarray:
        """Seconds to send ``nbytes`` split over ``messages`` tensors (0 where nbytes == 0)."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        messages = np.maximum(np.asarray(messages, dtype=np.float64), 1.0)
        bw = np.inf if self.bandwidth_Bps is None else self.bandwidth_Bps
        if self.samples:
            xs = np.array([s for s, _ in self.samples], dtype=np.float64)
            ys = np.array([t for _, t in self.samples])
            per = nbytes / messages
            t = np.interp(per, xs, ys) + np.maximum(per - xs[-1], 0.0) / bw
            out = messages * (t + self.overhead_s)
        else:
            out = messages * (self.latency_s + self.overhead_s) + nbytes / bw
        return np.where(nbytes > 0, out, 0.0)

    def transfer_s(self, nbytes: float, messages: int = 1) -> float:
        return float(self.one_way_s(np.array(nbytes), np.array(messages)))


class Cluster(FrozenModel):
    """The devices of a pipeline, stage j on ``devices[j]``, and the link between neighbours."""

    schema_: Literal["pipeplan.cluster/1"] = Field(default=CLUSTER_SCHEMA, alias="schema")
    devices: tuple[Device, ...] = Field(min_length=1)
    link: Link = Link()
    op_overhead_s: float = Field(default=0.0, ge=0)
    """Fixed seconds the pipeline engine spends per stage on every micro-batch's forward and on
    every backward (scheduling, Python, autograd set-up), beyond the profiled compute; measured
    by ``pipeplan calibrate`` on a pipeline of the cluster's ranks."""
    solo_op_overhead_s: float | None = Field(default=None, ge=0)
    """o for a 1-stage plan: the same engine with no peer, no transfers and no transport threads
    competing for the cores (``pipeplan calibrate`` runs a 1-rank pipeline for it).  ``None``:
    ``op_overhead_s``."""
    step_overhead_s: float = Field(default=0.0, ge=0)
    """c: the engine's fixed seconds per training step outside every operation and update
    (zeroing gradients, splitting the batch, setting up the schedule, collecting the loss).
    Every rank pays it at the same time, so a step pays it once; ``pipeplan calibrate``
    measures it on one rank."""
    allreduce: Link | None = None
    """The all-reduce that sums a tied parameter's gradient over the stages holding it, as a
    link whose one-way time of s bytes is the whole all-reduce (flatten, sum, copy back),
    measured by ``pipeplan calibrate`` on the runtime's own path.  ``None``: two one-way trips
    of ``link`` (each rank sends its gradient and receives the sum)."""
    contention: float = Field(default=0.0, ge=0)
    """kappa: the fractional slowdown of a stage's forward and backward while another stage
    computes at the same time, as in a pipeline's steady state (ranks sharing cores, memory
    bandwidth or the transport's threads); 0 for devices that share nothing.  Measured by
    ``pipeplan calibrate`` from the engine's cost at two operation lengths."""
    update_contention: float = Field(default=0.0, ge=0)
    """kappa_u: the fractional slowdown of a stage's optimizer update while another stage's
    update runs at the same time (ranks sharing cores and memory bandwidth); 0 for devices that
    share nothing.  While a updates run at once each progresses at rate 1 / (1 + kappa_u (a - 1))
    (:mod:`pipeplan.planner.costmodel`).  Measured by ``pipeplan calibrate`` from Adam steps timed alone
    and on two ranks at once."""

    data_parallel: int = Field(default=1, ge=1)
    """d: data-parallel ranks per stage, each taking 1 / d of the global batch
    (:mod:`pipeplan.planner.collectives`)."""
    data_parallel_mode: Literal["replicate", "shard"] = "replicate"
    """How the d ranks of a stage hold its training state: ``replicate`` (a whole copy each,
    gradients all-reduced after the last backward) or ``shard`` (FSDP2: parameters, gradients
    and optimizer states sharded, parameters all-gathered for the step, gradients
    reduce-scattered after the last backward)."""
    replica_link: Link | None = None
    """The link between a stage's data-parallel ranks; ``None``: ``link``."""
    collectives: dict[
        Literal["all_reduce", "reduce_scatter", "all_gather"], tuple[float, float]
    ] = {}
    """Measured collectives (``pipeplan calibrate``): kind -> (seconds per byte, seconds) at
    ``collective_ranks`` ranks, an affine fit of the runtime's own calls; a kind not measured
    is modelled as a ring on ``replica_link``."""
    collective_ranks: int = Field(default=2, ge=2)  # the ranks ``collectives`` were measured on

    tensor_parallel: int = Field(default=1, ge=1)
    """t: the ranks each stage's (chunk's) transformer blocks are split over, Megatron-style
    (:mod:`pipeplan.solvers.tensor_parallel`); a stage runs on t d ranks, its t in one node."""
    sequence_parallel: bool = False
    """With t > 1: the ops between the blocks' projections run on 1 / t of the sequence
    (Megatron's ``--sequence-parallel``; :mod:`pipeplan.intake.tp_sequence`)."""
    loss_parallel: bool = False
    """With t > 1: the loss reads the vocabulary-split head's logits split (``loss_parallel``)."""
    devices_per_node: int | None = Field(default=None, ge=1)
    """K: devices in one node.  Tensor-parallel groups stay inside a node (t <= K); ``None``:
    one node holds every device."""
    intra_node_link: Link | None = None
    """The link between two devices of one node (NVLink): the tensor-parallel collectives, and
    the pipeline's or the replicas' transfers where their peers share a node (else ``link``)."""
    tp_op_overhead_s: float = Field(default=0.0, ge=0)
    """o_tp: host seconds torch's tensor parallelism adds per split projection and pass beyond
    its compute and collective (DTensor's wrapping, propagation, redistribution, the wait for
    the later rank); o_sp: sequence parallelism's per collective, one a row-wise projection
    in the forward, two in the backward.  Measured by ``pipeplan calibrate`` on pairs of ranks
    (:mod:`pipeplan.runtime.tp_overhead`), 0 where not."""
    tp_sequence_overhead_s: float = Field(default=0.0, ge=0)

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @classmethod
    def homogeneous(
        cls,
        stages: int,
        memory_bytes: int,
        link: Link | None = None,
        op_overhead_s: float = 0.0,
        contention: float = 0.0,
        update_contention: float = 0.0,
    ) -> Cluster:
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        devices = tuple(Device(name=f"dev{j}", memory_bytes=memory_bytes) for j in range(stages))
        return cls(
            devices=devices,
            link=link or Link(),
            op_overhead_s=op_overhead_s,
            contention=contention,
            update_contention=update_contention,
        )

    @property
    def n_stages(self) -> int:
        return len(self.devices)

    @property
    def uniform_speed(self) -> bool:
        return len({d.speed for d in self.devices}) == 1

    @property
    def engine_overhead_s(self) -> float:
        """o in effect: ``solo_op_overhead_s`` for a 1-stage cluster when measured, else
        ``op_overhead_s``."""
        if self.n_stages == 1 and self.solo_op_overhead_s is not None:
            return self.solo_op_overhead_s
        return self.op_overhead_s

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds to sum ``nbytes`` of gradient over the stages that hold a tied parameter."""
        if nbytes <= 0:
            return 0.0
        if self.allreduce is not None:
            return self.allreduce.transfer_s(nbytes)
        return 2.0 * self.link.transfer_s(nbytes)
