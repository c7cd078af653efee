"""The types that cross package boundaries: Profile, Cluster, Plan and RunReport.

These are the only coupling between ``profiler``, ``solvers`` and ``runtime``.  Each is a frozen
pydantic model, so a file read from disk is validated field by field and an error names the bad
field (see :mod:`planner.io`).

Notation used throughout pipeplan:

    n = number of units (partition atoms, "layers"), u = 1..n in topological order
    p = number of stages (one device each), j = 0..p-1
    B = batch size, m = number of micro-batches, b = B / m = micro-batch size
    f_u(b), g_u(b) = forward / backward seconds of unit u at micro-batch size b
    a_u(b) = bytes saved for backward by unit u, w_u = parameter bytes of unit u
    x_k(b) = bytes live across the cut before unit k (x_0 = the model's inputs)
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CLUSTER_SCHEMA",
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "PLAN_SCHEMA",
    "PROFILE_SCHEMA",
    "REPORT_SCHEMA",
    "CheckpointPolicy",
    "Cluster",
    "Cut",
    "CutTensor",
    "Device",
    "DeviceInfo",
    "Link",
    "MemoryBreakdown",
    "OptimizerName",
    "Plan",
    "PlanOptions",
    "Profile",
    "RunReport",
    "ScheduleName",
    "SharedParam",
    "Stage",
    "StageMeasurement",
    "TiedSync",
    "Timing",
    "Unit",
]

PROFILE_SCHEMA: Final = "pipeplan.profile/1"
PLAN_SCHEMA: Final = "pipeplan.plan/1"
CLUSTER_SCHEMA: Final = "pipeplan.cluster/1"
REPORT_SCHEMA: Final = "pipeplan.run-report/1"

CheckpointPolicy = Literal["always", "except_last", "never"]
ScheduleName = Literal["gpipe", "1f1b"]
OptimizerName = Literal["sgd", "momentum", "adam"]
#: ``--optimizer`` choices (``momentum`` is SGD with momentum 0.9).
OPTIMIZERS: tuple[OptimizerName, ...] = ("sgd", "momentum", "adam")

#: Optimizer state tensors kept per parameter (k in the memory model).
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _canonical_hash(obj: BaseModel) -> str:
    text = json.dumps(obj.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------


class Timing(_Frozen):
    """One unit measured at one micro-batch size (medians over the repeats)."""

    forward_s: float = Field(ge=0)
    """Median forward seconds."""
    backward_s: float = Field(ge=0)
    """Median backward seconds."""
    forward_spread_s: float = Field(default=0.0, ge=0)
    """Interquartile range of the forward repeats."""
    backward_spread_s: float = Field(default=0.0, ge=0)
    """Interquartile range of the backward repeats."""
    saved_bytes: int = Field(ge=0)
    """Bytes saved for backward (``saved_tensors_hooks``): a_u(b)."""
    output_bytes: int = Field(ge=0)
    """Bytes of the unit's outputs."""
    peak_bytes: int | None = Field(default=None, ge=0)
    """CUDA only: the larger ``max_memory_allocated`` growth of the unit's forward and of its
    backward inside a pass, each from what was allocated when it started."""
    recompute_backward_s: float | None = Field(default=None, ge=0)
    """Median backward seconds when the unit runs under non-reentrant activation checkpointing
    (the recomputed forward, the checkpoint's hooks and the backward); when absent the cost
    model uses forward_s + backward_s."""
    recompute_forward_s: float | None = Field(default=None, ge=0)
    """Median forward seconds under non-reentrant activation checkpointing: the forward a
    recomputing stage runs first, its saved tensors packed away by the checkpoint's hooks.  It
    costs more than forward_s (one hook call per saved tensor).  When absent the cost model uses
    forward_s."""


class Unit(_Frozen):
    """A partition atom: consecutive graph nodes, usually one block of a repeated container."""

    index: int = Field(ge=0)
    name: str
    nodes: tuple[str, ...]
    """Names of the traced graph's nodes that belong to this unit, in graph order."""
    params: tuple[str, ...] = ()
    """Qualified names of the parameters and buffers the unit uses."""
    param_bytes: int = Field(ge=0)
    """w_u: bytes of the parameters the unit owns (a shared parameter counts once, where first used)."""
    timings: dict[int, Timing]
    """Measurements keyed by micro-batch size b."""


class CutTensor(_Frozen):
    """One tensor live across a cut (activation, residual or skip connection)."""

    node: str
    """Graph node that produces it."""
    bytes_per_sample: int = Field(ge=0)


class Cut(_Frozen):
    """The cut between unit ``after`` and unit ``after + 1``."""

    after: int = Field(ge=0)
    tensors: tuple[CutTensor, ...]
    bytes_per_sample: int = Field(ge=0)
    """x_k per sample: the sum over ``tensors``."""


class SharedParam(_Frozen):
    """A parameter used by several units (e.g. a tied embedding and LM head).

    Its bytes count in ``param_bytes`` of its first user (the owner).  Every other stage that
    holds one of its users keeps a copy too (with gradients and optimizer state), which the cost
    model adds to that stage's memory.
    """

    name: str
    bytes: int = Field(ge=0)
    units: tuple[int, ...] = Field(min_length=2)
    """The units that use it, ascending; ``units[0]`` owns it."""


class DeviceInfo(_Frozen):
    kind: Literal["cpu", "cuda"]
    name: str
    threads: int | None = None
    """CPU: ``torch.get_num_threads()`` while measuring."""
    memory_bytes: int | None = None


class Profile(_Frozen):
    """Per-unit costs of one model at several micro-batch sizes, measured on one device."""

    schema_: Literal["pipeplan.profile/1"] = Field(default=PROFILE_SCHEMA, alias="schema")
    model: str
    """The ``package.module:callable`` name the profile was made from."""
    model_kwargs: dict[str, str | int | float | bool] = {}
    tracer: Literal["fx", "export"]
    graph_fingerprint: str
    device: DeviceInfo
    torch_version: str
    dtype: str
    batch_size: int = Field(gt=0)
    microbatch_sizes: tuple[int, ...]
    granularity: str = "auto"
    warmup: int = Field(default=1, ge=0)
    repeats: int = Field(default=1, ge=1)
    rounds: int = Field(default=1, ge=1)
    """Sweeps over all sizes and units; times are medians over rounds of medians over repeats."""
    input_bytes_per_sample: int = Field(ge=0)
    """x_0: bytes of the model's inputs per sample (stage 0 stashes them)."""
    units: tuple[Unit, ...]
    cuts: tuple[Cut, ...]
    """n - 1 cuts; ``cuts[k]`` lies between ``units[k]`` and ``units[k + 1]``."""
    shared_params: tuple[SharedParam, ...] = ()
    loss: dict[int, Timing] = {}
    """The loss on the model's output, by micro-batch size: the last stage pays it per
    micro-batch, and keeps its saved tensors for every micro-batch in flight."""
    update_s: dict[OptimizerName, float] = {}
    """Seconds of one optimizer step over all the model's parameters (each once), by optimizer
    (:func:`planner.optim.make_optimizer`); a stage pays the share of its parameter bytes, once
    per training step.  Empty in profiles made before it was measured: updates are then free."""
    update_curve: dict[OptimizerName, tuple[tuple[int, float], ...]] = {}
    """(parameter bytes, seconds) of one optimizer step over the parameters of units 0..k for a
    few growing k, the cache cold before each step, by optimizer; the cost model fits U(w) to
    them (:mod:`planner.updates`), since a step's time grows faster than its bytes once its
    lists outgrow the cache.  Empty in profiles made before it was measured: ``update_s`` is
    then spread evenly over the bytes."""
    checkpoint_call_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds that one ``torch.utils.checkpoint`` call adds by itself,
    measured on a trivial function.  Every unit's recompute times include it once; a
    recomputing stage makes one call, so the cost model takes it out of each unit and charges
    it once per stage.  (0, 0) in profiles made before it was measured."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _check(self) -> Profile:
        n = len(self.units)
        if n == 0:
            raise ValueError("a profile needs at least one unit")
        if [u.index for u in self.units] != list(range(n)):
            raise ValueError("units must be numbered 0..n-1 in order")
        if [c.after for c in self.cuts] != list(range(n - 1)):
            raise ValueError(f"expected {n - 1} cuts numbered 0..{n - 2}")
        for sp in self.shared_params:
            if list(sp.units) != sorted(set(sp.units)) or not 0 <= sp.units[0] <= sp.units[-1] < n:
                raise ValueError(
                    f"shared parameter {sp.name}: units {sp.units} must be ascending in 0..{n - 1}"
                )
        for size in self.microbatch_sizes:
            if size <= 0 or self.batch_size % size:
                raise ValueError(
                    f"micro-batch size {size} does not divide batch size {self.batch_size}"
                )
            for u in self.units:
                if size not in u.timings:
                    raise ValueError(f"unit {u.index} ({u.name}) has no timing at size {size}")
        return self

    @property
    def n_units(self) -> int:
        return len(self.units)

    @property
    def fingerprint(self) -> str:
        """Hash of the whole profile's content (a plan records it)."""
        return _canonical_hash(self)

    def to_frame(self) -> pd.DataFrame:
        """One row per (unit, micro-batch size): times, bytes, and the cut after the unit."""
        import pandas as pd

        rows = []
        for u in self.units:
            cut = self.cuts[u.index].bytes_per_sample if u.index < len(self.cuts) else 0
            for b, t in sorted(u.timings.items()):
                rows.append(
                    {
                        "unit": u.index,
                        "name": u.name,
                        "microbatch_size": b,
                        "forward_s": t.forward_s,
                        "backward_s": t.backward_s,
                        "forward_spread_s": t.forward_spread_s,
                        "backward_spread_s": t.backward_spread_s,
                        "saved_bytes": t.saved_bytes,
                        "output_bytes": t.output_bytes,
                        "param_bytes": u.param_bytes,
                        "cut_bytes_per_sample": cut,
                    }
                )
        return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------------------------


class Device(_Frozen):
    name: str
    memory_bytes: int = Field(gt=0)
    speed: float = Field(default=1.0, gt=0)
    """Relative speed: unit times measured on the profiling device are divided by it."""


class Link(_Frozen):
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


class Cluster(_Frozen):
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
    (:mod:`planner.costmodel`).  Measured by ``pipeplan calibrate`` from Adam steps timed alone
    and on two ranks at once."""

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


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


class PlanOptions(_Frozen):
    """What a user asks of a solver besides the profile and the cluster."""

    microbatches: int | None = Field(default=None, gt=0)
    """m, or ``None`` to choose it among the profiled micro-batch sizes."""
    checkpoint: CheckpointPolicy = "except_last"
    schedule: ScheduleName = "gpipe"
    optimizer: OptimizerName = "adam"
    pinned: dict[int, int] = {}
    """unit index -> stage index (CP-SAT only)."""
    min_units: int = Field(default=1, ge=1)
    """Fewest units per stage (values above 1: CP-SAT only)."""
    max_units: int | None = Field(default=None, ge=1)
    """Most units per stage (CP-SAT only)."""
    time_limit_s: float | None = Field(default=None, gt=0)
    """Wall-clock limit for solvers that search (CP-SAT)."""


class MemoryBreakdown(_Frozen):
    params: int
    grads: int
    optimizer: int
    stashed_inputs: int
    """In-flight micro-batches times the stage's input bytes (when recomputing)."""
    activations: int
    """Bytes saved for backward: one micro-batch's when recomputing, else all in flight."""
    total: int


class Stage(_Frozen):
    index: int
    device: str
    first_unit: int
    last_unit: int
    """Inclusive."""
    unit_names: tuple[str, ...]
    recompute: bool
    forward_s: float
    """F_j per micro-batch (on this stage's device)."""
    backward_s: float
    """B_j per micro-batch, recompute included."""
    comm_s: float
    """C_j: send the cut's activations forward and receive their gradient back."""
    time_s: float
    """t_j = F_j + B_j + C_j."""
    update_s: float = 0.0
    """U_j: the optimizer's update of the stage's parameters, once per step after its last
    backward."""
    memory: MemoryBreakdown
    memory_limit: int
    feasible: bool


class TiedSync(_Frozen):
    """One all-reduce of tied gradients: the stages that hold copies of the same parameters
    sum their gradients after their last backward, before their updates (one per distinct set
    of stages, in ascending order of the sets, as the runtime does)."""

    stages: tuple[int, ...] = Field(min_length=2)
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)


class Plan(_Frozen):
    """A partition of a profile's units into stages plus the micro-batch count, evaluated."""

    schema_: Literal["pipeplan.plan/1"] = Field(default=PLAN_SCHEMA, alias="schema")
    model: str
    model_kwargs: dict[str, str | int | float | bool] = {}
    profile_fingerprint: str
    graph_fingerprint: str
    tracer: Literal["fx", "export"] = "fx"
    granularity: str = "auto"
    """How the profile grouped graph nodes into units; the runtime regroups the same way."""
    dtype: str = "float32"
    profiled_threads: int | None = None
    """CPU threads per process while profiling; a CPU run should give each rank as many."""
    batch_size: int
    microbatches: int
    microbatch_size: int
    schedule: ScheduleName
    checkpoint: CheckpointPolicy
    optimizer: OptimizerName
    cluster: Cluster
    stages: tuple[Stage, ...]
    tied_syncs: tuple[TiedSync, ...] = ()
    """The all-reduces of tied gradients this partition needs (none when no shared parameter
    spans two stages)."""
    step_time_s: float
    """Closed-form step time T(m) of :mod:`planner.costmodel` (the solvers' objective)."""
    simulated_step_time_s: float | None = None
    """The schedule simulator's makespan for these stage times: equal to ``step_time_s`` for
    identical stages and for two stages when one is the bottleneck both forward and backward;
    larger when the forward and backward bottlenecks are different stages (GPipe pays both
    maxima), smaller when an early stage is the backward bottleneck (a later stage's update
    then overlaps more of the drain than D_j)."""
    bubble_fraction: float
    """1 - (average busy time per device) / step time."""
    throughput: float
    """Samples per second: B / step time."""
    feasible: bool
    """Every stage fits its device's memory."""
    solver: str
    status: Literal["optimal", "feasible", "infeasible", "unknown", "heuristic"]
    gap: float | None = None
    """Relative optimality gap when a search stopped early."""
    lower_bound_s: float | None = None
    solve_time_s: float | None = None
    """Wall-clock solve time; ``None`` in reproducible files (the default)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """First unit of every stage after the first (the cut positions)."""
        return tuple(s.first_unit for s in self.stages[1:])

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def fingerprint(self) -> str:
        """Hash of the plan's content (a run report records it)."""
        return _canonical_hash(self)

    def to_frame(self) -> pd.DataFrame:
        """One row per stage: unit range, F/B/C/t seconds, memory breakdown and limit."""
        import pandas as pd

        rows = []
        for s in self.stages:
            rows.append(
                {
                    "stage": s.index,
                    "device": s.device,
                    "first_unit": s.first_unit,
                    "last_unit": s.last_unit,
                    "units": s.last_unit - s.first_unit + 1,
                    "recompute": s.recompute,
                    "forward_s": s.forward_s,
                    "backward_s": s.backward_s,
                    "comm_s": s.comm_s,
                    "time_s": s.time_s,
                    **{f"mem_{k}": v for k, v in s.memory.model_dump().items()},
                    "memory_limit": s.memory_limit,
                    "feasible": s.feasible,
                }
            )
        return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Run report
# --------------------------------------------------------------------------------------------


class StageMeasurement(_Frozen):
    stage: int
    forward_s: tuple[float, ...]
    """Per micro-batch forward seconds, median over measured steps."""
    backward_s: tuple[float, ...]
    peak_memory_bytes: int | None = None
    threads: int | None = None


class RunReport(_Frozen):
    schema_: Literal["pipeplan.run-report/1"] = Field(default=REPORT_SCHEMA, alias="schema")
    plan_fingerprint: str
    model: str
    backend: str
    world_size: int
    steps: int
    warmup_steps: int
    step_times_s: tuple[float, ...]
    step_time_s: float
    """Median measured step time."""
    predicted_step_time_s: float
    stages: tuple[StageMeasurement, ...]
    losses: tuple[float, ...] = ()
    events: tuple[dict[str, str | int | float], ...] = ()
    """Timeline events (name, stage, microbatch, start_s, end_s) of the last measured step."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
