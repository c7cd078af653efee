"""What the runtime measured: a run report, one per plan run (``pipeplan run --report``)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from pipeplan.planner.types.base import (
    REPORT_SCHEMA,
    FrozenModel,
)

__all__ = ["RankMeasurement", "RunReport", "StageMeasurement"]


class StageMeasurement(FrozenModel):
    """One stage (a chunk, for a plan of several chunks per rank)."""

    stage: int
    forward_s: tuple[float, ...]
    """Per micro-batch forward seconds, median over measured steps."""
    backward_s: tuple[float, ...]
    """Per micro-batch backward seconds: the full backward B, or I + W where it is split."""
    peak_memory_bytes: int | None = None
    """Peak bytes of live tensors: CUDA's ``max_memory_allocated``; on CPU, the tensors live
    at the start of one profiled step plus the peak of its allocations (``pipeplan.runtime.memory``).
    The rank's peak; ``None`` for a plan of several chunks per rank (see ``RunReport.ranks``)."""
    threads: int | None = None
    resident_growth_bytes: int | None = None
    """CPU: the process's peak resident-set growth over its baseline (``pipeplan.runtime.memory``)."""
    rank: int | None = None
    """The rank (device) that ran it."""
    backward_input_s: tuple[float, ...] = ()
    """Per micro-batch seconds of the split backward's I (zero-bubble schedules), else empty."""
    backward_weight_s: tuple[float, ...] = ()
    """Per micro-batch seconds of the split backward's W (zero-bubble schedules), else empty."""


class RankMeasurement(FrozenModel):
    """One rank (device) of the first replica: its stages and its memory."""

    rank: int
    stages: tuple[int, ...]
    """The stages (chunks) it ran, in the order the schedule takes them."""
    peak_memory_bytes: int | None = None
    """As :attr:`StageMeasurement.peak_memory_bytes`, over all its stages: what
    ``Plan.rank_peak_bytes`` predicts."""
    threads: int | None = None
    resident_growth_bytes: int | None = None


class RunReport(FrozenModel):
    schema_: Literal["pipeplan.run-report/1"] = Field(default=REPORT_SCHEMA, alias="schema")
    plan_fingerprint: str
    model: str
    backend: str
    world_size: int
    """Every rank of the run: pipeline ranks x data-parallel x tensor-parallel degrees (the
    stages and ranks below are the first replica's, tp index 0)."""
    steps: int
    warmup_steps: int
    step_times_s: tuple[float, ...]
    step_time_s: float
    """Median measured step time."""
    predicted_step_time_s: float
    stages: tuple[StageMeasurement, ...]
    ranks: tuple[RankMeasurement, ...] = ()
    """Per rank of the first replica (reports before 0.2 have none)."""
    losses: tuple[float, ...] = ()
    events: tuple[dict[str, str | int | float], ...] = ()
    """Timeline events (name, kind, stage, microbatch, start_s, end_s, and chunk) of the last
    measured step; ``stage`` is the rank (device) that ran it, ``chunk`` the plan's stage."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
