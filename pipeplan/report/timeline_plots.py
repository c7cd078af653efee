"""Figures of schedule timelines: the simulated step of a plan, and a measured step beside it.

Every function returns a :class:`matplotlib.figure.Figure` with an Agg canvas, made without
pyplot (:func:`pipeplan.report.canvas.new_figure`).  A row per device, a block per operation; measured
and simulated steps are frames of the same columns (:data:`pipeplan.report.frames.EVENT_COLUMNS`), so
they are drawn by the same code:

    gantt(plan | replay)                one row per device, the simulated step
    measured_vs_simulated(report, plan) the measured step above the simulated one

Each block carries a ``gid`` naming what it shows (``"forward/2/5"`` = forward of stage 2,
micro-batch 5), so tests and users can find it.  Work is drawn solid; waiting is drawn light
and hatched (kind ``wait``: a stage that has arrived at a collective, such as the tied
gradients' all-reduce, and waits for the others, :func:`pipeplan.report.frames.split_waits`),
and idle time is the white background.  A new kind of operation (a schedule's chunks, its
input- and weight-gradient halves) needs only an entry in :data:`KIND_STYLE`.  Figures that compare plans are in
:mod:`pipeplan.report.plots`.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from pipeplan.planner.replay import Replay, replay_plan
from pipeplan.planner.types import Plan, RunReport
from pipeplan.report.canvas import new_figure
from pipeplan.report.frames import events_frame, split_waits, timeline_frame

__all__ = ["KIND_STYLE", "gantt", "measured_vs_simulated"]

#: Face colour and hatch of each event kind; waiting is light and hatched, idle time is the
#: white background.
KIND_STYLE: dict[str, tuple[str, str]] = {
    "forward": ("#4C72B0", ""),
    "backward": ("#55A868", ""),
    "backward_input": ("#8FD19E", ""),
    "backward_weight": ("#2E7D46", ""),
    "recompute": ("#A6C8E8", "///"),
    "send": ("#C8C8C8", "..."),
    "recv": ("#C8C8C8", "..."),
    "loss": ("#C44E52", ""),
    "tied": ("#937860", "xx"),
    "optimizer": ("#CCB974", ""),
    "wait": ("#F0F0F0", "\\\\\\"),
}
_LABELLED = {"forward", "backward", "backward_input", "backward_weight", "loss"}


def _draw_schedule(ax: Axes, events: pd.DataFrame, p: int, xmax_s: float) -> None:
    """Draw events (a frame of :data:`pipeplan.report.frames.EVENT_COLUMNS`) as rows of rectangles."""
    ms = 1e3
    chunks = "chunk" in events and bool((events["chunk"] != events["stage"]).any())
    for e in events.itertuples(index=False):
        color, hatch = KIND_STYLE.get(e.kind, ("#999999", "xx"))
        # a white edge separates neighbouring blocks but would hide a sliver: draw those solid
        sliver = e.duration_s < 0.004 * xmax_s
        rect = Rectangle(
            (e.start_s * ms, e.stage - 0.4),
            e.duration_s * ms,
            0.8,
            facecolor=color,
            hatch=hatch,
            edgecolor=color if sliver else "white",
            linewidth=0 if sliver else 0.5,
        )
        rect.set_gid(f"{e.kind}/{e.stage}/{e.microbatch}")
        ax.add_patch(rect)
        if e.kind in _LABELLED and e.microbatch >= 0 and e.duration_s >= 0.012 * xmax_s:
            ax.text(
                (e.start_s + e.duration_s / 2) * ms,
                e.stage,
                f"c{e.chunk}:{e.microbatch}" if chunks else str(e.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_xlim(0, xmax_s * ms * 1.01 if xmax_s > 0 else 1)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_xlabel("time (ms)")
    ax.set_facecolor("white")
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)


def _bubble(events: pd.DataFrame, p: int, end_s: float) -> float:
    """1 - work per device / step: waiting counts as idle, every other event as work."""
    work = events.loc[events["kind"] != "wait", "duration_s"].sum()
    return 1.0 - float(work) / p / end_s if end_s > 0 else 0.0


def _stage_labels(ax: Axes, plan: Plan | None, p: int) -> None:
    if plan is not None and len(plan.stages) != p:  # several chunks per rank: one row each
        from pipeplan.planner.families import stages_of_rank

        ax.set_yticklabels([
            f"rank {r}\nchunks {', '.join(map(str, stages_of_rank(plan.schedule, p, plan.stages_per_rank, r)))}"
            for r in range(p)
        ])  # fmt: skip
        return
    devices = [s.device for s in plan.stages] if plan is not None else [None] * p
    ax.set_yticklabels([f"stage {j}" + (f"\n{d}" if d else "") for j, d in enumerate(devices)])


def _kind_legend(ax: Axes, kinds: set[str]) -> None:
    handles = [
        Patch(facecolor=c, hatch=h, edgecolor="white", label=k)
        for k, (c, h) in KIND_STYLE.items()
        if k in kinds and k != "recv"
    ]
    if kinds & {"send", "recv"}:
        for hd in handles:
            if hd.get_label() == "send":
                hd.set_label("send/recv")
        if "send" not in kinds:
            c, h = KIND_STYLE["recv"]
            handles.append(Patch(facecolor=c, hatch=h, edgecolor="white", label="send/recv"))
    for hd in handles:
        if hd.get_label() == "wait":
            hd.set_label("waiting for the others")
    handles.append(Patch(facecolor="white", edgecolor="#888888", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def gantt(
    source: Plan | Replay,
    *,
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """The simulated schedule of a plan's step (or of a ready replay), one row per device.

    Forward and backward of every micro-batch are blocks labelled with the micro-batch number
    (``c2:3``, chunk 2's micro-batch 3, where a rank runs several chunks), recompute is hatched light blue, transfers dotted grey; a stage waiting at the tied
    gradients' all-reduce for the others is light grey, hatched; white is idle time (the bubble).
    The title gives the step time and the bubble fraction (waiting counted as idle).
    """
    plan = source if isinstance(source, Plan) else None
    if plan is not None:
        timeline = replay_plan(plan)
    elif isinstance(source, Replay):
        timeline = source
    else:
        raise TypeError(f"gantt needs a Plan or a Replay, got {type(source).__name__}")
    p, m = timeline.p, timeline.m
    events = split_waits(timeline_frame(timeline))
    fig = new_figure(figsize or (10, 0.6 * p + 1.6))
    ax = fig.add_subplot()
    _draw_schedule(ax, events, p, timeline.makespan_s)
    _stage_labels(ax, plan, p)
    _kind_legend(ax, set(events["kind"]))
    if title is None:
        head = f"{plan.schedule} {plan.solver}, " if plan is not None else ""
        model = f" (cost model {plan.step_time_s * 1e3:.2f} ms)" if plan is not None else ""
        title = (
            f"{head}p={p}, m={m}: step {timeline.makespan_s * 1e3:.2f} ms{model}, "
            f"bubble {_bubble(events, p, timeline.makespan_s):.1%}"
        )
    ax.set_title(title)
    return fig


def measured_vs_simulated(report: RunReport, plan: Plan) -> Figure:
    """The measured last step of a run (top) above the plan's simulated step, same time axis."""
    if report.plan_fingerprint != plan.fingerprint:
        raise ValueError(
            f"the report is of plan {report.plan_fingerprint} but this plan is {plan.fingerprint}; "
            f"pass the plan file the run executed"
        )
    if not report.events:
        raise ValueError("the report has no events; rerun `pipeplan run` with a recent runtime")
    measured = split_waits(events_frame(report))
    timeline = replay_plan(plan)
    simulated = split_waits(timeline_frame(timeline))
    p = plan.n_stages
    measured_end = float(measured["end_s"].max())
    xmax = max(measured_end, timeline.makespan_s)
    fig = new_figure((10, 1.2 * p + 2.6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for ax, frame, end, what in (
        (top, measured, measured_end, f"measured (last of {report.steps} steps)"),
        (bottom, simulated, timeline.makespan_s, "simulated"),
    ):
        bub = _bubble(frame, p, end)
        _draw_schedule(ax, frame, p, xmax)
        _stage_labels(ax, plan, p)
        _kind_legend(ax, set(frame["kind"]))
        ax.set_title(f"{what}: step {end * 1e3:.2f} ms, bubble {bub:.1%}")
    top.set_xlabel("")
    fig.suptitle(
        f"{plan.model}: median measured step {report.step_time_s * 1e3:.2f} ms vs predicted "
        f"{report.predicted_step_time_s * 1e3:.2f} ms "
        f"({report.step_time_s / report.predicted_step_time_s:.2f}x)"
        if report.predicted_step_time_s > 0
        else plan.model
    )
    return fig
