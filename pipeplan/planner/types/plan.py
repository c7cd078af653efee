"""A solver's answer: the request's options, and the evaluated partition with its stages."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, field_validator

from pipeplan.planner.types.base import (
    PLAN_SCHEMA,
    CheckpointPolicy,
    FrozenModel,
    OptimizerName,
    ScheduleChoice,
    ScheduleName,
    canonical_hash,
)
from pipeplan.planner.types.cluster import Cluster

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["MemoryBreakdown", "Plan", "PlanOptions", "Stage", "TiedSync", "WeighedFamily"]


class PlanOptions(FrozenModel):
    """What a user asks of a solver besides the profile and the cluster."""

    microbatches: int | None = Field(default=None, gt=0)
    """m, or ``None`` to choose it among the profiled micro-batch sizes."""
    checkpoint: CheckpointPolicy = "auto"
    """Which stages recompute their forward in the backward: ``auto`` (each stage keeps its
    activations where that fits its device and recomputes where it does not, or, in the
    zero-bubble families, where its fused backward beats the split I + W: never slower than
    any fixed policy), ``always``, ``except_last`` (torchgpipe's) or ``never``."""
    schedule: ScheduleChoice = "gpipe"
    """A schedule family (:mod:`pipeplan.planner.families`) or ``auto``: every family, its
    chunks per rank, cuts, m and recomputation chosen together
    (:mod:`pipeplan.solvers.multichunk`)."""
    optimizer: OptimizerName = "adam"
    pinned: dict[int, int] = {}
    """unit index -> stage index (CP-SAT only)."""
    min_units: int = Field(default=1, ge=1)
    """Fewest units per stage (values above 1: CP-SAT only)."""
    max_units: int | None = Field(default=None, ge=1)
    """Most units per stage (CP-SAT only)."""
    time_limit_s: float | None = Field(default=None, gt=0)
    """Wall-clock limit for solvers that search (CP-SAT)."""
    search_work: int | None = Field(default=None, ge=0)
    """The schedule solver's local-search budget: actions it may replay, summed over its
    replays (``None``: :data:`pipeplan.solvers.multichunk.SEARCH_WORK`; 0 keeps the best of
    its seeds).  A count, not a clock, so that a plan does not depend on the host's load."""
    prove: float = Field(default=0.0, ge=0)
    """The schedule solver's exact model (:mod:`pipeplan.solvers.exact_order`): CP-SAT's
    deterministic time per (family, v, m) candidate whose bound can still win (0: off).  It
    starts from the search's plan, looks only below the best step, and turns the status to
    ``optimal`` where every candidate is proven; elsewhere it tightens the gap."""
    families: tuple[ScheduleName, ...] | None = None
    """The families ``schedule="auto"`` may choose among (``None``: every one): the schedules a
    target framework runs (``pipeplan plan --for``, :data:`pipeplan.export.TARGET_FAMILIES`)."""
    allowed_cuts: tuple[int, ...] | None = None
    """The units a stage other than the first may start at (``None``: any unit), in
    increasing order: where a target framework can cut (``pipeplan plan --for``,
    :func:`pipeplan.export.snap.target_cuts`).  Every solver and baseline keeps to them."""

    @field_validator("allowed_cuts")
    @classmethod
    def _cuts_increase(cls, cuts: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if cuts is not None and (
            any(b <= a for a, b in itertools.pairwise(cuts)) or (cuts and cuts[0] < 1)
        ):
            raise ValueError(f"allowed_cuts {list(cuts)} must be distinct units >= 1, in order")
        return cuts


class MemoryBreakdown(FrozenModel):
    """A stage's memory at its peak (:func:`pipeplan.planner.costmodel.memory_parts`)."""

    params: int
    grads: int
    """0 where the peak comes at the first backward, before any gradient exists."""
    optimizer: int
    stashed_inputs: int
    """The inputs of every micro-batch: stage 0's share of the batch, a later stage's receive
    buffers (one per micro-batch); a recomputing stage stashes these."""
    activations: int
    """Bytes saved for backward: one micro-batch's when recomputing, else all in flight (the
    last stage adds the loss's, per micro-batch in flight)."""
    gradient_buffers: int = 0
    """The receive buffers of the output's gradient, one per micro-batch (0 on the last stage)."""
    outputs: int = 0
    """The stage's outputs held until their backward, per micro-batch in flight (the last
    stage's are the model's outputs)."""
    transient: int = 0
    """Working gradients at the peak: the input's, on the last stage the loss's and the
    output's, and the largest parameter's where it sets the peak (made before it is added to
    the held one); for a sharded stage whose reduction sets a later peak, what that adds
    (:mod:`pipeplan.planner.collectives`)."""
    total: int


class Stage(FrozenModel):
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
    backward_input_s: float | None = None
    """I_j: the backward's input-gradient part, for schedules that split it (zero-bubble)."""
    backward_weight_s: float | None = None
    """W_j: the backward's weight-gradient part (zero-bubble schedules)."""
    time_s: float
    """t_j = F_j + B_j + C_j."""
    update_s: float = 0.0
    """U_j: the optimizer's update of the stage's parameters, after its last backward."""
    memory: MemoryBreakdown
    memory_limit: int
    feasible: bool


class TiedSync(FrozenModel):
    """One all-reduce of tied gradients: the stages that hold copies of the same parameters
    sum their gradients after their last backward, before their updates (one per distinct set
    of stages, in ascending order of the sets, as the runtime does)."""

    stages: tuple[int, ...] = Field(min_length=2)
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)


class WeighedFamily(FrozenModel):
    """What ``schedule="auto"`` found for one family: its best plan's v, m and step, or, where
    it searched none, the candidate whose lower bound came closest."""

    family: ScheduleName
    stages_per_rank: int = Field(ge=1)
    microbatches: int = Field(ge=1)
    step_time_s: float | None = None
    """The replayed step of the family's best plan found (``None``: no plan of it fits, or its
    bound could not beat the chosen plan, so it was not searched)."""
    lower_bound_s: float
    """The family's lowest bound over its candidates
    (:func:`pipeplan.solvers.schedule_bounds.family_bound`)."""


class Plan(FrozenModel):
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
    stages_per_rank: int = Field(default=1, ge=1)
    """v: the chunks each rank runs; ``stages`` then lists p v chunks, chunk s on the rank
    :func:`pipeplan.planner.families.rank_of_stage` names (a loop, or a V for zbv/dualpipev)."""
    rank_peak_bytes: tuple[int, ...] = ()
    """Per rank: the peak memory walked along torch's action order
    (:func:`pipeplan.planner.replay.peak_memory`); empty for plans of the closed-form solvers."""
    checkpoint: CheckpointPolicy
    optimizer: OptimizerName
    cluster: Cluster
    stages: tuple[Stage, ...]
    tied_syncs: tuple[TiedSync, ...] = ()
    """The all-reduces of tied gradients this partition needs (none when no shared parameter
    spans two stages)."""
    step_time_s: float
    """Closed-form step time T(m) of :mod:`pipeplan.planner.costmodel` (the solvers' objective)."""
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
    layout: tuple[tuple[int, ...], ...] = ()
    """With ``cluster.data_parallel`` d > 1 or ``cluster.tensor_parallel`` t > 1: the first
    global rank of each replica's pipeline ranks (replica r's rank j on ranks
    ``layout[r][j]`` .. ``layout[r][j] + t - 1``, which is (r p + j) t: the device mesh
    (dp, pp, tp), tensor-parallel ranks consecutive within a node); empty for one pipeline on
    ranks 0..p-1."""
    weighed: tuple[WeighedFamily, ...] = ()
    """Under ``schedule="auto"``: each family the solver weighed, with its best plan found
    (``pipeplan plan`` and ``show`` print them beside the chosen plan); empty otherwise."""
    solver: str
    status: Literal["optimal", "feasible", "infeasible", "unknown", "heuristic"]
    gap: float | None = None
    """Relative optimality gap when a search stopped early."""
    lower_bound_s: float | None = None
    solve_time_s: float | None = None
    """Wall-clock solve time; ``None`` in reproducible files (the default)."""
    model_sha256: str | None = None
    """The profile's ``model_sha256``: the model's config file, checked by ``pipeplan run``."""
    batch_dependent_layers: tuple[str, ...] = ()
    """The profile's batch-dependent layers (BatchNorm), named in ``plan`` and ``run`` output."""
    unit_expansions: tuple[str, ...] = ()
    """The profile's ``grouping.expanded``: the runtime regroups the graph with them."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """First unit of every stage after the first (the cut positions)."""
        return tuple(s.first_unit for s in self.stages[1:])

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def pipeline_ranks(self) -> int:
        """p: the ranks one pipeline runs on, the stages (chunks) over the chunks per rank."""
        return len(self.stages) // self.stages_per_rank

    @property
    def fingerprint(self) -> str:
        """Hash of the plan's content (a run report records it)."""
        return canonical_hash(self)

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
