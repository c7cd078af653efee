"""Turn the ranks' measurements into a RunReport, a Chrome trace, and a measured-vs-predicted table.

Each rank returns a :class:`RankRecord`; rank 0 gathers them.  A step's time is the slowest
rank's (every rank starts the step after a barrier); a stage's (chunk's) forward and backward
seconds are per micro-batch medians over the measured steps, the last stage's forward
including the loss, its backward the full backward B or, where a zero-bubble schedule splits
it, I + W (each also on its own).  Times are compared per stage (chunk) with the plan's
stages; memory per rank, the unit the planner predicts it for (the stage's own for one chunk
per rank, ``Plan.rank_peak_bytes`` for several).  The measured bubble fraction is
``1 - mean_r busy_r / step`` on the last measured step, where ``busy_r`` is rank r's forward,
loss and backward time (what the cost model calls F + B per micro-batch, summed over its
chunks and micro-batches); the tied-gradient sum and the optimizer step appear in the trace
but not in ``busy_r``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeplan.planner.io import format_bytes
from pipeplan.planner.replay import Replay, replay_plan
from pipeplan.planner.types import Plan, RankMeasurement, RunReport, StageMeasurement
from pipeplan.runtime.timing import Span

__all__ = [
    "RankRecord",
    "build_report",
    "chrome_trace",
    "measured_bubble",
    "pipeline_ranks",
    "print_comparison",
]

#: Span kind -> the letter of the schedule's action (F, B, I, W).
_LETTERS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
_COMPUTE = ("forward", "loss", "backward", "backward_input", "backward_weight")


@dataclass(slots=True)
class RankRecord:
    """What one rank measured over the measured (post-warm-up) steps."""

    stage: int
    """The rank in its pipeline (its stage, for one chunk per rank)."""
    threads: int | None
    walls: list[float] = field(default_factory=list)
    spans: list[list[Span]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    """Loss of every step, warm-up included (last stage only)."""
    peak_memory_bytes: int | None = None
    resident_growth_bytes: int | None = None
    chunks: list[int] = field(default_factory=list)
    """The stages (chunks) the rank runs; empty means stage ``stage`` alone."""


def _chunk_of(span: Span, chunks: Sequence[int], last: int) -> int:
    """The stage a span belongs to: its own, else (loss, or a span made without one) the
    rank's last stage for the loss and its first for the rest."""
    if span.stage >= 0:
        return span.stage
    return last if span.kind == "loss" and last in chunks else chunks[0]


def _per_microbatch(
    spans: Sequence[Sequence[Span]], kinds: set[str], m: int, chunk: int, chunks: Sequence[int],
    last: int,
) -> tuple[float, ...]:  # fmt: skip
    per_step = []
    for step in spans:
        t = [0.0] * m
        for s in step:
            if s.kind in kinds and 0 <= s.microbatch < m and _chunk_of(s, chunks, last) == chunk:
                t[s.microbatch] += s.duration_s
        per_step.append(t)
    return tuple(statistics.median(col) for col in zip(*per_step)) if per_step else ()


def _event_name(span: Span) -> str:
    if span.kind in _LETTERS:
        return f"{_LETTERS[span.kind]}{span.microbatch}"
    return span.kind


def _stages(plan: Plan, r: RankRecord) -> list[StageMeasurement]:
    """The measurements of the stages rank ``r`` ran."""
    m, last = plan.microbatches, plan.n_stages - 1
    chunks = r.chunks or [r.stage]
    one = len(chunks) == 1
    out = []
    for c in chunks:

        def per_mb(kinds: set[str], c: int = c) -> tuple[float, ...]:
            return _per_microbatch(r.spans, kinds, m, c, chunks, last)

        split = any(s.kind == "backward_input" for step in r.spans for s in step)
        out.append(
            StageMeasurement(
                stage=c,
                forward_s=per_mb({"forward", "loss"}),
                backward_s=per_mb({"backward", "backward_input", "backward_weight"}),
                peak_memory_bytes=r.peak_memory_bytes if one else None,
                threads=r.threads,
                resident_growth_bytes=r.resident_growth_bytes if one else None,
                rank=r.stage,
                backward_input_s=per_mb({"backward_input"}) if split else (),
                backward_weight_s=per_mb({"backward_weight"}) if split else (),
            )
        )
    return out


def build_report(
    plan: Plan,
    records: Sequence[RankRecord],
    *,
    backend: str,
    warmup_steps: int,
) -> RunReport:
    records = sorted(records, key=lambda r: r.stage)
    last = plan.n_stages - 1
    n_steps = min(len(r.walls) for r in records)
    step_times = tuple(max(r.walls[i] for r in records) for i in range(n_steps))
    stages = sorted((s for r in records for s in _stages(plan, r)), key=lambda s: s.stage)
    ranks = tuple(
        RankMeasurement(
            rank=r.stage,
            stages=tuple(r.chunks or [r.stage]),
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
                    "chunk": _chunk_of(s, r.chunks or [r.stage], last),
                    "microbatch": s.microbatch,
                    "start_s": s.start_s,
                    "end_s": s.end_s,
                }
            )
    return RunReport(
        plan_fingerprint=plan.fingerprint,
        model=plan.model,
        backend=backend,
        world_size=plan.pipeline_ranks * plan.cluster.data_parallel * plan.cluster.tensor_parallel,
        steps=n_steps,
        warmup_steps=warmup_steps,
        step_times_s=step_times,
        step_time_s=statistics.median(step_times) if step_times else 0.0,
        predicted_step_time_s=plan.step_time_s,
        stages=tuple(stages),
        ranks=ranks,
        losses=tuple(next((r.losses for r in records if r.losses), [])),
        events=tuple(events),
    )


def gather_report(
    plan: Plan, record: RankRecord, *, backend: str, warmup_steps: int
) -> RunReport | None:
    """Gather every rank's record on rank 0 and build the report there (``None`` elsewhere):
    the first replica's ranks (tp index 0: ranks j t), whose losses are the global batch's."""
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(record, gathered, dst=0)
    if gathered is None:
        return None
    t = plan.cluster.tensor_parallel
    first = gathered[: plan.pipeline_ranks * t : t]
    return build_report(plan, first, backend=backend, warmup_steps=warmup_steps)


def pipeline_ranks(report: RunReport) -> int:
    """The ranks the report measured: one pipeline, the first replica's (every rank of the
    run before reports had ``ranks``)."""
    return len(report.ranks) or report.world_size


def measured_bubble(report: RunReport) -> float | None:
    """1 - mean busy time per rank / step time, on the last measured step."""
    if not report.events or not report.step_times_s:
        return None
    busy = [0.0] * pipeline_ranks(report)
    for e in report.events:
        if e["kind"] in _COMPUTE:
            busy[int(e["stage"])] += float(e["end_s"]) - float(e["start_s"])
    step = report.step_times_s[-1]
    return 1.0 - sum(busy) / len(busy) / step if step > 0 else None


def chrome_trace(report: RunReport, plan: Plan | None = None) -> dict[str, Any]:
    """Chrome-trace / Perfetto JSON of the last measured step: one process (pid) per rank,
    one thread (tid) per stage (chunk) it runs, F, B, I and W spans named with their
    micro-batch (``F3``).

    With ``plan``, the simulator's predicted timeline is added as processes ``1000 + r``.
    """
    events: list[dict[str, Any]] = []
    chunks: dict[int, list[int]] = {r.rank: list(r.stages) for r in report.ranks}
    for j in range(pipeline_ranks(report)):
        mine = chunks.get(j, [j])
        label = f"stage {j}" if mine == [j] else f"rank {j}"
        events.append({"ph": "M", "name": "process_name", "pid": j, "args": {"name": label}})
        for c in mine:
            thread = {"name": f"stage {c}"}
            events.append({"ph": "M", "name": "thread_name", "pid": j, "tid": c, "args": thread})
    for e in report.events:
        events.append(
            {
                "name": e["name"],
                "cat": e["kind"],
                "ph": "X",
                "pid": e["stage"],
                "tid": e.get("chunk", e["stage"]),
                "ts": float(e["start_s"]) * 1e6,
                "dur": (float(e["end_s"]) - float(e["start_s"])) * 1e6,
                "args": {"microbatch": e["microbatch"]},
            }
        )
    if plan is not None:
        for j in range(plan.pipeline_ranks):
            name = {"name": f"predicted {'stage' if plan.stages_per_rank == 1 else 'rank'} {j}"}
            events.append({"ph": "M", "name": "process_name", "pid": 1000 + j, "args": name})
        timeline = _simulated(plan)
        for ev in timeline.events if timeline is not None else ():
            letter = _LETTERS.get(ev.kind, ev.kind[0].upper())
            events.append(
                {
                    "name": f"{letter}{ev.microbatch}" if ev.microbatch >= 0 else ev.kind,
                    "cat": f"predicted {ev.kind}",
                    "ph": "X",
                    "pid": 1000 + ev.rank,
                    "tid": 0,
                    "ts": ev.start_s * 1e6,
                    "dur": (ev.end_s - ev.start_s) * 1e6,
                    "args": {"microbatch": ev.microbatch},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _simulated(plan: Plan) -> Replay | None:
    """The simulator's timeline of ``plan``; ``None`` for a zero-bubble plan whose stages
    lack I and W times (made by hand: the solvers always give them), or one torch's schedule
    class refuses (1F1B with fewer micro-batches than stages)."""
    try:
        return replay_plan(plan)
    except ValueError:
        return None


def _err(measured: float, predicted: float) -> str:
    if predicted <= 0:
        return "-"
    return f"{(measured - predicted) / predicted:+.1%}"


def _mean(values: Sequence[float]) -> float:
    return statistics.mean(values) if values else 0.0


def _bytes(n: int | None) -> str:
    return format_bytes(n) if n is not None else "-"


def print_comparison(report: RunReport, plan: Plan, console: Console) -> None:
    """Measured vs predicted per stage (per chunk for several chunks per rank: F, B, and I and
    W where the backward is split), memory per rank, then step time and bubble fraction, with
    relative errors."""
    title = (
        f"{report.model}: measured vs predicted ({report.backend}, {report.world_size} ranks, "
        f"m = {plan.microbatches}, {report.steps} steps)"
    )
    if plan.stages_per_rank == 1:
        _stage_table(report, plan, console, title)
    else:
        _chunk_tables(report, plan, console, title)
    timeline = _simulated(plan)
    bubble = measured_bubble(report)
    simulated = (
        f", {timeline.makespan_s * 1e3:.3f} ms simulated "
        f"({_err(report.step_time_s, timeline.makespan_s)})"
        if timeline is not None
        else ""
    )
    console.print(
        f"step time {report.step_time_s * 1e3:.3f} ms measured (median of {report.steps}), "
        f"{plan.step_time_s * 1e3:.3f} ms predicted ({_err(report.step_time_s, plan.step_time_s)})"
        f"{simulated}"
    )
    if bubble is not None:
        console.print(
            f"bubble fraction {bubble:.1%} measured, {plan.bubble_fraction:.1%} predicted"
        )


def _stage_table(report: RunReport, plan: Plan, console: Console, title: str) -> None:
    """One chunk per rank: a row per stage, memory on it."""
    table = Table(title=title)
    for col in ("stage", "threads", "F ms", "pred", "err", "B ms", "pred", "err", "peak mem",
                "pred mem", "err", "resident"):  # fmt: skip
        table.add_column(col, justify="right")
    for s, ps in zip(report.stages, plan.stages):
        f, b = _mean(s.forward_s), _mean(s.backward_s)
        table.add_row(
            str(s.stage),
            str(s.threads or "-"),
            f"{f * 1e3:.3f}",
            f"{ps.forward_s * 1e3:.3f}",
            _err(f, ps.forward_s),
            f"{b * 1e3:.3f}",
            f"{ps.backward_s * 1e3:.3f}",
            _err(b, ps.backward_s),
            _bytes(s.peak_memory_bytes),
            format_bytes(ps.memory.total),
            _err(s.peak_memory_bytes, ps.memory.total) if s.peak_memory_bytes else "-",
            _bytes(s.resident_growth_bytes),
        )
    console.print(table)


def _chunk_tables(report: RunReport, plan: Plan, console: Console, title: str) -> None:
    """Several chunks per rank: times per chunk, memory per rank (``Plan.rank_peak_bytes``)."""
    split = any(s.backward_input_s for s in report.stages)
    table = Table(title=title)
    cols = ["stage", "rank", "F ms", "pred", "err", "B ms", "pred", "err"]
    cols += ["I ms", "pred", "err", "W ms", "pred", "err"] if split else []
    for col in cols:
        table.add_column(col, justify="right")
    for s in report.stages:
        ps = plan.stages[s.stage]
        row = [str(s.stage), str(s.rank)]
        pairs = [(s.forward_s, ps.forward_s), (s.backward_s, ps.backward_s)]
        if split:
            pairs += [(s.backward_input_s, ps.backward_input_s or 0.0),
                      (s.backward_weight_s, ps.backward_weight_s or 0.0)]  # fmt: skip
        for got, want in pairs:
            row += [f"{_mean(got) * 1e3:.3f}", f"{want * 1e3:.3f}", _err(_mean(got), want)]
        table.add_row(*row)
    console.print(table)
    mem = Table(title="memory per rank")
    for col in ("rank", "stages", "threads", "peak mem", "pred mem", "err", "resident"):
        mem.add_column(col, justify="right")
    for r in report.ranks:
        pred = plan.rank_peak_bytes[r.rank] if r.rank < len(plan.rank_peak_bytes) else None
        peak = r.peak_memory_bytes
        mem.add_row(
            str(r.rank),
            ", ".join(map(str, r.stages)),
            str(r.threads or "-"),
            _bytes(peak),
            _bytes(pred),
            _err(peak, pred) if peak and pred else "-",
            _bytes(r.resident_growth_bytes),
        )
    console.print(mem)
