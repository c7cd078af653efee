"""Turn the ranks' measurements into a RunReport, a Chrome trace, and a measured-vs-predicted table.

Each rank returns a :class:`RankRecord`; rank 0 gathers them.  A step's time is the slowest
rank's (every rank starts the step after a barrier); a stage's forward and backward seconds
are per micro-batch medians over the measured steps, the last stage's forward including the
loss.  The measured bubble fraction is ``1 - mean_j busy_j / step`` on the last measured step,
where ``busy_j`` is stage j's forward, loss and backward time (what the cost model calls
F_j + B_j per micro-batch, summed over micro-batches); the tied-gradient sum and the optimizer
step appear in the trace but not in ``busy_j``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.planner.io import format_bytes
from pipeplan.planner.simulate import simulate_plan
from pipeplan.planner.types import Plan, RunReport, StageMeasurement
from pipeplan.runtime.timing import Span

__all__ = ["RankRecord", "build_report", "chrome_trace", "measured_bubble", "print_comparison"]


@dataclass(slots=True)
class RankRecord:
    """What one rank measured over the measured (post-warm-up) steps."""

    stage: int
    threads: int | None
    walls: list[float] = field(default_factory=list)
    spans: list[list[Span]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    """Loss of every step, warm-up included (last stage only)."""
    peak_memory_bytes: int | None = None
    resident_growth_bytes: int | None = None


def _per_microbatch(spans: Sequence[Sequence[Span]], kinds: set[str], m: int) -> tuple[float, ...]:
    per_step = []
    for step in spans:
        t = [0.0] * m
        for s in step:
            if s.kind in kinds and 0 <= s.microbatch < m:
                t[s.microbatch] += s.duration_s
        per_step.append(t)
    return tuple(statistics.median(col) for col in zip(*per_step)) if per_step else ()


def _event_name(span: Span) -> str:
    if span.kind in ("forward", "backward"):
        return f"{span.kind[0].upper()}{span.microbatch}"
    return span.kind


def build_report(
    plan: Plan,
    records: Sequence[RankRecord],
    *,
    backend: str,
    warmup_steps: int,
) -> RunReport:
    records = sorted(records, key=lambda r: r.stage)
    m = plan.microbatches
    n_steps = min(len(r.walls) for r in records)
    step_times = tuple(max(r.walls[i] for r in records) for i in range(n_steps))
    stages = tuple(
        StageMeasurement(
            stage=r.stage,
            forward_s=_per_microbatch(r.spans, {"forward", "loss"}, m),
            backward_s=_per_microbatch(r.spans, {"backward"}, m),
            peak_memory_bytes=r.peak_memory_bytes,
            threads=r.threads,
            resident_growth_bytes=r.resident_growth_bytes,
        )
        for r in records
    )
    events: list[dict[str, str | int | float]] = []
    for r in records:
        for s in r.spans[-1] if r.spans else ():
            events.append(
                {
                    "name": _event_name(s),
                    "kind": s.kind,
                    "stage": r.stage,
                    "microbatch": s.microbatch,
                    "start_s": s.start_s,
                    "end_s": s.end_s,
                }
            )
    return RunReport(
        plan_fingerprint=plan.fingerprint,
        model=plan.model,
        backend=backend,
        world_size=len(records),
        steps=n_steps,
        warmup_steps=warmup_steps,
        step_times_s=step_times,
        step_time_s=statistics.median(step_times) if step_times else 0.0,
        predicted_step_time_s=plan.step_time_s,
        stages=stages,
        losses=tuple(next((r.losses for r in records if r.losses), [])),
        events=tuple(events),
    )


def gather_report(
    plan: Plan, record: RankRecord, *, backend: str, warmup_steps: int
) -> RunReport | None:
    """Gather every rank's record on rank 0 and build the report there (``None`` elsewhere):
    the first replica's stages (ranks 0..p-1), whose losses are the global batch's."""
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(record, gathered, dst=0)
    if gathered is None:
        return None
    first = gathered[: plan.n_stages]
    return build_report(plan, first, backend=backend, warmup_steps=warmup_steps)


def measured_bubble(report: RunReport) -> float | None:
    """1 - mean busy time per stage / step time, on the last measured step."""
    if not report.events or not report.step_times_s:
        return None
    busy = [0.0] * report.world_size
    for e in report.events:
        if e["kind"] in ("forward", "loss", "backward"):
            busy[int(e["stage"])] += float(e["end_s"]) - float(e["start_s"])
    step = report.step_times_s[-1]
    return 1.0 - sum(busy) / len(busy) / step if step > 0 else None


def chrome_trace(report: RunReport, plan: Plan | None = None) -> dict[str, Any]:
    """Chrome-trace / Perfetto JSON of the last measured step: one process (pid) per stage.

    With ``plan``, the simulator's predicted timeline is added as processes ``1000 + j``.
    """
    events: list[dict[str, Any]] = []
    for j in range(report.world_size):
        events.append({"ph": "M", "name": "process_name", "pid": j, "args": {"name": f"stage {j}"}})
    for e in report.events:
        events.append(
            {
                "name": e["name"],
                "cat": e["kind"],
                "ph": "X",
                "pid": e["stage"],
                "tid": 0,
                "ts": float(e["start_s"]) * 1e6,
                "dur": (float(e["end_s"]) - float(e["start_s"])) * 1e6,
                "args": {"microbatch": e["microbatch"]},
            }
        )
    if plan is not None:
        for j in range(plan.n_stages):
            name = {"name": f"predicted stage {j}"}
            events.append({"ph": "M", "name": "process_name", "pid": 1000 + j, "args": name})
        for ev in simulate_plan(plan).events:
            events.append(
                {
                    "name": f"{ev.kind[0].upper()}{ev.microbatch}"
                    if ev.microbatch >= 0
                    else ev.kind,
                    "cat": f"predicted {ev.kind}",
                    "ph": "X",
                    "pid": 1000 + ev.stage,
                    "tid": 0,
                    "ts": ev.start_s * 1e6,
                    "dur": (ev.end_s - ev.start_s) * 1e6,
                    "args": {"microbatch": ev.microbatch},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _err(measured: float, predicted: float) -> str:
    if predicted <= 0:
        return "-"
    return f"{(measured - predicted) / predicted:+.1%}"


def print_comparison(report: RunReport, plan: Plan, console: Console) -> None:
    """Measured vs predicted per stage, then step time and bubble fraction, with relative errors."""
    table = Table(
        title=f"{report.model}: measured vs predicted ({report.backend}, "
        f"{report.world_size} ranks, m = {plan.microbatches}, {report.steps} steps)"
    )
    for col in (
        "stage",
        "threads",
        "F ms",
        "pred",
        "err",
        "B ms",
        "pred",
        "err",
        "peak mem",
        "pred mem",
        "err",
        "resident",
    ):
        table.add_column(col, justify="right")
    for s, ps in zip(report.stages, plan.stages):
        f = statistics.mean(s.forward_s) if s.forward_s else 0.0
        b = statistics.mean(s.backward_s) if s.backward_s else 0.0
        table.add_row(
            str(s.stage),
            str(s.threads or "-"),
            f"{f * 1e3:.3f}",
            f"{ps.forward_s * 1e3:.3f}",
            _err(f, ps.forward_s),
            f"{b * 1e3:.3f}",
            f"{ps.backward_s * 1e3:.3f}",
            _err(b, ps.backward_s),
            format_bytes(s.peak_memory_bytes) if s.peak_memory_bytes is not None else "-",
            format_bytes(ps.memory.total),
            _err(s.peak_memory_bytes, ps.memory.total) if s.peak_memory_bytes else "-",
            format_bytes(s.resident_growth_bytes) if s.resident_growth_bytes is not None else "-",
        )
    console.print(table)
    sim = simulate_plan(plan).makespan_s
    bubble = measured_bubble(report)
    console.print(
        f"step time {report.step_time_s * 1e3:.3f} ms measured (median of {report.steps}), "
        f"{plan.step_time_s * 1e3:.3f} ms predicted ({_err(report.step_time_s, plan.step_time_s)}), "
        f"{sim * 1e3:.3f} ms simulated ({_err(report.step_time_s, sim)})"
    )
    if bubble is not None:
        console.print(
            f"bubble fraction {bubble:.1%} measured, {plan.bubble_fraction:.1%} predicted"
        )
