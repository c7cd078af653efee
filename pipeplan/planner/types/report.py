"""What the runtime measured: a run report, one per plan run (``pipeplan run --report``)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from pipeplan.planner.types.base import (
    REPORT_SCHEMA,
    FrozenModel,
)

__all__ = ["RunReport", "StageMeasurement"]


class StageMeasurement(FrozenModel):
    stage: int
    forward_s: tuple[float, ...]
    """Per micro-batch forward seconds, median over measured steps."""
    backward_s: tuple[float, ...]
    peak_memory_bytes: int | None = None
    """Peak bytes of live tensors: CUDA's ``max_memory_allocated``; on CPU, the tensors live
    at the start of one profiled step plus the peak of its allocations (``pipeplan.runtime.memory``)."""
    threads: int | None = None
    resident_growth_bytes: int | None = None
    """CPU: the process's peak resident-set growth over its baseline (``pipeplan.runtime.memory``)."""


class RunReport(FrozenModel):
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
