"""The profiler's output: per-unit times and bytes of one model at several micro-batch sizes.

A :class:`Profile` holds n :class:`Unit` s in topological order, each with a :class:`Timing` per
profiled micro-batch size, the n - 1 :class:`Cut` s between them, the parameters several units
share, the loss, and the optimizer's measured step.  Notation: :mod:`pipeplan.planner.types`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, model_validator

from pipeplan.planner.types.base import (
    PROFILE_SCHEMA,
    FrozenModel,
    OptimizerName,
    canonical_hash,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Cut",
    "CutTensor",
    "DeviceInfo",
    "Grouping",
    "Profile",
    "SharedParam",
    "Timing",
    "Unit",
    "UnitTensorParallel",
]


class Timing(FrozenModel):
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
    backward_input_s: float | None = Field(default=None, ge=0)
    """I: median seconds of the gradient with respect to the unit's inputs alone (torch's
    ``stage_backward_input``); with ``backward_weight_s`` needed by the zero-bubble schedules."""
    backward_weight_s: float | None = Field(default=None, ge=0)
    """W: median seconds of the gradient with respect to its weights (``stage_backward_weight``)."""
    weight_held_bytes: int | None = Field(default=None, ge=0)
    """Bytes that stay alive from I until W (what the weight gradient still needs)."""


class Grouping(FrozenModel):
    """How ``auto`` grouped the graph into units (:mod:`pipeplan.intake.refine`)."""

    max_stages: int = Field(ge=1)
    """The largest stage count the units were refined for (``--max-stages``)."""
    base_units: int = Field(ge=1)
    """Units before refinement: the items of the containers, and the glue between them."""
    expanded: tuple[str, ...] = ()
    """Modules split into their children (``""``: the glue's root) and cuts before graph nodes
    (``cut:NODE``), in the order chosen; ``pipeplan.intake.graph.group_units(traced, "auto",
    expanded)`` rebuilds the units from them."""


TensorParallelStyle = Literal["colwise", "rowwise", "colwise_gather"]
"""``colwise_gather``: a head split over the vocabulary, its output gathered whole."""


class UnitTensorParallel(FrozenModel):
    """How one unit splits over t tensor-parallel ranks (``pipeplan.intake.tp_layout`` finds
    it, ``pipeplan.profiler`` measures it; :mod:`pipeplan.solvers.tensor_parallel` prices it).

    Megatron's split of a transformer block: the projections that open a sub-block (query,
    key, value; gate and up) column-wise, the ones that close it (output; down) row-wise, so
    that each sub-block's heads or hidden units are local and one all-reduce of the block's
    output (per sample ``allreduce_bytes_per_sample``) closes each sub-block in the forward,
    and one of its input's gradient in the backward.
    """

    styles: dict[str, TensorParallelStyle]
    """Qualified module name in the model -> how its weight is split."""
    divisors: dict[str, int] = {}
    """Dimension name (``heads``, ``kv_heads``, ``hidden``, ``intermediate``) -> its size, which
    t must divide."""
    sharded_param_bytes: int = Field(ge=0)
    """Of the unit's ``param_bytes``, those divided by t (the split projections' weights and
    their column-wise biases)."""
    sharded_flop_fraction: float = Field(ge=0, le=1)
    """Of the unit's forward FLOPs, the share that t ranks divide (the projections and the
    attention between them)."""
    sharded_saved_fraction: float = Field(default=0.0, ge=0, le=1)
    """Of the unit's ``saved_bytes``, the share divided by t (what the split sub-blocks save)."""
    sequence_saved_fraction: float = Field(default=0.0, ge=0, le=1)
    """The share sequence parallelism divides too (what per-token ops save; 0 if not known)."""
    allreduces: int = Field(default=0, ge=0)
    """All-reduces per forward (one per row-wise projection), as many again in the backward."""
    allreduce_bytes_per_sample: int = Field(default=0, ge=0)
    """Bytes those all-reduces sum, per sample, in the forward (the backward's are the same)."""
    allgather_bytes_per_sample: int = Field(default=0, ge=0)
    """Bytes a ``colwise_gather`` head's forward all-gathers per sample (its whole output)."""
    gather_input_bytes_per_sample: int = Field(default=0, ge=0)
    """That head's input per sample, whose gradient its backward all-reduces."""


class Unit(FrozenModel):
    """A partition atom: consecutive graph nodes, usually one block of a repeated container."""

    index: int = Field(ge=0)
    name: str
    nodes: tuple[str, ...]
    """Names of the traced graph's nodes that belong to this unit, in graph order."""
    params: tuple[str, ...] = ()
    """Qualified names of the parameters and buffers the unit uses."""
    param_bytes: int = Field(ge=0)
    """w_u: bytes of the parameters the unit owns (a shared parameter counts once, where first used)."""
    largest_param_bytes: int = Field(default=0, ge=0)
    """Bytes of the largest parameter the unit uses (owned or shared): from the second
    micro-batch on, its gradient is made in a temporary before it is added to the one held.
    0 in profiles made before it was recorded."""
    timings: dict[int, Timing]
    """Measurements keyed by micro-batch size b."""
    measured_as: int | None = Field(default=None, ge=0)
    """The unit whose measurement ``timings`` copies (``--method units``: an identical unit,
    measured once, :mod:`pipeplan.profiler.units`); ``None``: measured itself."""
    tensor_parallel: UnitTensorParallel | None = None
    """How the unit splits over tensor-parallel ranks; ``None``: it does not (every rank of a
    tensor-parallel group runs it whole)."""
    tp_timings: dict[int, dict[int, Timing]] = {}
    """Measured per-rank timings with the unit split t ways on t ranks, collectives included:
    t -> micro-batch size -> Timing (``pipeplan profile --tensor-parallel``); a t absent here is
    modelled from ``timings`` (:mod:`pipeplan.solvers.tensor_parallel`)."""


class CutTensor(FrozenModel):
    """One tensor live across a cut (activation, residual or skip connection)."""

    node: str
    """Graph node that produces it."""
    bytes_per_sample: int = Field(ge=0)


class Cut(FrozenModel):
    """The cut between unit ``after`` and unit ``after + 1``."""

    after: int = Field(ge=0)
    tensors: tuple[CutTensor, ...]
    bytes_per_sample: int = Field(ge=0)
    """x_k per sample: the sum over ``tensors``."""
    tp_gather_bytes_per_sample: int = Field(default=0, ge=0)
    """Of ``tensors``, the bytes per sample tensor parallelism holds split by heads (T5's
    relative-position bias): a stage ending here all-gathers them over its t ranks before it
    sends them (:mod:`pipeplan.profiler.tp_annotate`, :mod:`pipeplan.intake.tp_stages`)."""


class SharedParam(FrozenModel):
    """A parameter used by several units (e.g. a tied embedding and LM head).

    Its bytes count in ``param_bytes`` of its first user (the owner).  Every other stage that
    holds one of its users keeps a copy too (with gradients and optimizer state), which the cost
    model adds to that stage's memory.
    """

    name: str
    bytes: int = Field(ge=0)
    units: tuple[int, ...] = Field(min_length=2)
    """The units that use it, ascending; ``units[0]`` owns it."""


class DeviceInfo(FrozenModel):
    kind: Literal["cpu", "cuda"]
    name: str
    threads: int | None = None
    """CPU: ``torch.get_num_threads()`` while measuring."""
    memory_bytes: int | None = None


class Profile(FrozenModel):
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
    (:func:`pipeplan.planner.optim.make_optimizer`); a stage pays the share of its parameter bytes, once
    per training step.  Empty in profiles made before it was measured: updates are then free."""
    update_curve: dict[OptimizerName, tuple[tuple[int, float], ...]] = {}
    """(parameter bytes, seconds) of one optimizer step over the parameters of units 0..k for a
    few growing k, the cache cold before each step, by optimizer; the cost model fits U(w) to
    them (:mod:`pipeplan.planner.updates`), since a step's time grows faster than its bytes once its
    lists outgrow the cache.  Empty in profiles made before it was measured: ``update_s`` is
    then spread evenly over the bytes."""
    checkpoint_call_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds that one ``torch.utils.checkpoint`` call adds by itself,
    measured on a trivial function.  Every unit's recompute times include it once; a
    recomputing stage makes one call, so the cost model takes it out of each unit and charges
    it once per stage.  (0, 0) in profiles made before it was measured."""
    model_sha256: str | None = None
    """SHA-256 of the file the model was built from (``hf:PATH/config.json``), if any; a plan
    carries it and ``pipeplan run`` refuses a file that changed since."""
    batch_dependent_layers: tuple[str, ...] = ()
    """Layers whose output depends on the other samples of the batch (BatchNorm): in a pipeline
    they see one micro-batch at a time (see ``pipeplan run --batch-norm``)."""
    grouping: Grouping | None = None
    """How ``auto`` grouped the units (``None`` for other granularities and older profiles)."""
    tensor_parallel_note: str | None = None
    """Why the model plans tensor parallelism t = 1 only (no recognised block), in one line;
    ``None`` where its blocks split or it was not looked at."""
    method: Literal["whole", "units"] = "whole"
    """How the units were measured: inside whole training passes of the real model
    (:mod:`pipeplan.profiler.sweep`), or each distinct unit alone, materialized from a model built on
    ``meta`` (:mod:`pipeplan.profiler.units`).  Older profiles are ``whole``."""

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
        for u in self.units:
            if u.measured_as is not None and (
                u.measured_as >= u.index or self.units[u.measured_as].measured_as is not None
            ):
                raise ValueError(
                    f"unit {u.index} ({u.name}) is measured as unit {u.measured_as}, which must "
                    f"be an earlier unit measured itself"
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
        return canonical_hash(self)

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
