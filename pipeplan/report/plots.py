"""Figures that compare plans: stage balance, memory, micro-batch sweeps.

Every function returns a :class:`matplotlib.figure.Figure` with an Agg canvas, made without
pyplot (:func:`pipeplan.report.canvas.new_figure`): nothing is shown, no global backend is switched,
and figures are freed with their last reference.  Save one with ``fig.savefig`` or let a
notebook display it.  Figures are built from the package's data types only:

    stage_times(plans)                  t_j per stage, plans side by side, slowest marked
    stage_memory(plans)                 M_j stacked by kind against each device's limit
    compare_figure(plans)               step time per plan, busy time per step m·t_j per stage,
                                        and stage_memory (``compare --plot``)
    microbatch_sweep(profile, ...)      step time and bubble against m, with GPipe's ideal
    device_frontier(plans)              throughput against pipeline depth for N devices

Drawn artists carry a ``gid`` naming what they show (``"stage-time/0/2"`` = plan 0, stage 2;
``"slowest/0"``; ``"step-time/1"`` = plan 1's step; ``"memory-limit"``; ``"ideal-bubble"``), so tests and users can find them.
Schedule timelines (Gantt charts, measured against simulated) are in
:mod:`pipeplan.report.timeline_plots`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile
from pipeplan.report.canvas import new_figure
from pipeplan.report.frames import ideal_bubble, sweep_frame

__all__ = [
    "compare_figure",
    "device_frontier",
    "microbatch_sweep",
    "plan_names",
    "stage_memory",
    "stage_times",
]

_MEMORY_PARTS = [
    ("params", "params", "#4C72B0"),
    ("grads", "grads", "#8172B2"),
    ("optimizer", "optimizer", "#CCB974"),
    ("stashed_inputs", "inputs", "#64B5CD"),
    ("activations", "activations", "#55A868"),
    ("gradient_buffers", "gradient buffers", "#937860"),
    ("outputs", "outputs", "#DA8BC3"),
    ("transient", "working gradients", "#F1CE63"),  # not the limit line's red
]
_BALANCE = "perfect balance"  # a plan's mean t_j: what an even split of its work would give
_PLAN_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#937860", "#DA8BC3"]


def plan_names(plans: Sequence[Plan], names: Sequence[str] | None = None) -> list[str]:
    """``names``, checked, or ``"solver p=P m=M"`` per plan (numbered when two coincide)."""
    if names is not None:
        if len(names) != len(plans):
            raise ValueError(f"{len(names)} names for {len(plans)} plans; give one per plan")
        return list(names)
    base = [f"{p.solver} p={p.n_stages} m={p.microbatches}" for p in plans]
    return [f"{b} #{i}" if base.count(b) > 1 else b for i, b in enumerate(base)]


def _check_plans(plans: Sequence[Plan]) -> None:
    if isinstance(plans, Plan):
        raise TypeError("pass a list of plans, e.g. stage_times([plan])")
    if not plans:
        raise ValueError("no plans to draw; pass at least one Plan")


# --------------------------------------------------------------------------------------------
# Balance and memory
# --------------------------------------------------------------------------------------------


def _stage_bars(
    ax: Axes, i: int, k: int, ms: np.ndarray, line_ms: float, gids: tuple[str, str], **labels: str
) -> tuple[BarContainer, LineCollection, np.ndarray]:
    """Plan i of k's bars ``ms`` per stage (gid ``{gids[0]}/i/j``), side by side with the other
    plans', and a dashed line at ``line_ms`` over them in its colour (gid ``{gids[1]}/i``);
    ``labels`` (``bar=``, ``line=``) name them in the legend.  Returns both and the bars' x."""
    color, width = _PLAN_COLORS[i % len(_PLAN_COLORS)], 0.8 / k
    x = np.arange(len(ms)) + (i - (k - 1) / 2) * width
    bars = ax.bar(x, ms, width * 0.92, color=color, label=labels.get("bar", "_"))
    for j, bar in enumerate(bars):
        bar.set_gid(f"{gids[0]}/{i}/{j}")
    line = ax.hlines(line_ms, x[0] - width / 2, x[-1] + width / 2, colors=color,
                     linestyles="--", linewidth=1.8, gid=f"{gids[1]}/{i}",
                     label=labels.get("line", "_"))  # fmt: skip
    return bars, line, x


def _stage_ticks(ax: Axes, plans: Sequence[Plan]) -> None:
    pmax = max(p.n_stages for p in plans)
    ax.set_xticks(range(pmax))
    ax.set_xticklabels([f"stage {j}" for j in range(pmax)])


def _draw_stage_times(ax: Axes, plans: Sequence[Plan], names: list[str]) -> None:
    k = len(plans)
    entries: list[tuple[Artist, str]] = []
    for i, (plan, name) in enumerate(zip(plans, names)):
        t = np.array([s.time_s for s in plan.stages]) * 1e3
        bars, balance, x = _stage_bars(ax, i, k, t, t.mean(), ("stage-time", "mean-time"))
        j = int(np.argmax(t))
        (slowest,) = ax.plot(
            [x[j]],
            [t[j]],
            marker="v",
            markersize=9,
            color="black",
            linestyle="none",
            gid=f"slowest/{i}",
        )
        entries += [(bars.patches[0], name), (balance, f"{name}: {_BALANCE} {t.mean():.3g} ms")]
    entries.append((slowest, "slowest stage"))
    _stage_ticks(ax, plans)
    ax.set_ylabel("t_j per micro-batch (ms)")
    ax.set_title("Stage times t_j = F + B + C; the slowest stage sets the pipeline's pace")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    handles, labels = zip(*entries)
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def stage_times(plans: Sequence[Plan], names: Sequence[str] | None = None) -> Figure:
    """Per-stage time t_j of several plans side by side; each plan's slowest stage marked ▼.

    Each plan's dashed line, in its colour, is its mean stage time: what a perfectly balanced
    split of the same work would give.  The legend names it with its value ("dp: perfect
    balance 9.93 ms"); the gap between a plan's slowest bar and its line is what imbalance costs.
    """
    _check_plans(plans)
    fig = new_figure((10, 4))
    _draw_stage_times(fig.add_subplot(), plans, plan_names(plans, names))
    return fig


def _byte_scale(n: float) -> tuple[float, str]:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return float(scale), unit
    return 1.0, "B"


def _draw_stage_memory(axes: Sequence[Axes], plans: Sequence[Plan], names: list[str]) -> None:
    top_total = max(s.memory.total for p in plans for s in p.stages)
    top_limit = max(s.memory_limit for p in plans for s in p.stages)
    # scaled to the data: the limit joins the axis only when it is near the tallest stack
    # (else it is written at the top edge with an arrow)
    shown = max(top_total, top_limit if top_limit <= 1.5 * top_total else 0)
    scale, unit = _byte_scale(shown)
    ymax = shown * 1.12 / scale
    # one limit for every stage: the legend says it; limits that differ are written per stage
    distinct = sorted({s.memory_limit for p in plans for s in p.stages})
    limit_label = f"limit {format_bytes(distinct[0])}" if len(distinct) == 1 else "device limit"
    prev_limit = -1
    for i, (ax, plan, name) in enumerate(zip(axes, plans, names)):
        x = np.arange(plan.n_stages)
        bottom = np.zeros(plan.n_stages)
        for field, label, color in _MEMORY_PARTS:
            v = np.array([getattr(s.memory, field) for s in plan.stages]) / scale
            bars = ax.bar(x, v, 0.7, bottom=bottom, color=color, label=label)
            for j, bar in enumerate(bars):
                bar.set_gid(f"memory/{field}/{j}")
            bottom += v
        other = np.array([s.memory.total for s in plan.stages]) / scale - bottom
        if (other > 1e-9 * max(1.0, float(bottom.max()))).any():  # a breakdown field we don't know
            ax.bar(x, other, 0.7, bottom=bottom, color="#BBBBBB", label="other", gid="memory/other")
            bottom += other
        limits = np.array([s.memory_limit for s in plan.stages]) / scale
        ax.hlines(
            limits,
            x - 0.45,
            x + 0.45,
            colors="#C44E52",
            linewidth=2,
            gid="memory-limit",
            label=limit_label,
        )
        for j, s in enumerate(plan.stages):
            # label each run of stages with one limit, where it starts: always when the limit
            # lies above the axis, else only when the limits differ (the legend says a single one)
            off_axis = s.memory_limit / scale > ymax
            starts = j == 0 or s.memory_limit != prev_limit
            if starts and (off_axis or len(distinct) > 1):
                ax.annotate(
                    f"limit {format_bytes(s.memory_limit)}" + (" ↑" if off_axis else ""),
                    (j - 0.45, ymax * 0.97 if off_axis else s.memory_limit / scale),
                    xytext=(0, 0 if off_axis else 2),
                    textcoords="offset points",
                    ha="left",
                    va="top" if off_axis else "bottom",
                    fontsize=7,
                    color="#C44E52",
                    gid=f"memory-limit-label/{j}",
                )
            prev_limit = s.memory_limit
            if not s.feasible:
                ax.text(
                    j,
                    bottom[j],
                    "over",
                    ha="center",
                    va="bottom",
                    color="#C44E52",
                    fontsize=8,
                    fontweight="bold",
                )
        ax.set_ylim(0, ymax)
        ax.set_xticks(x)
        ax.set_xticklabels([str(j) for j in x])
        ax.set_xlabel("stage")
        ax.set_title(name, fontsize=9)
        if i == 0:
            ax.set_ylabel(f"memory ({unit})")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def stage_memory(plans: Sequence[Plan], names: Sequence[str] | None = None) -> Figure:
    """Per-stage memory of each plan, stacked by kind, against each device's limit (red line).

    The axis is in B, KiB, MiB or GiB, whichever suits the tallest stack; the limit is written
    in the legend ("limit 11.80 GiB") when every device has the same, else above the stage
    where it changes, and at the top edge, with an arrow, when it lies above the axis.
    """
    _check_plans(plans)
    fig = new_figure((max(6.0, 3.0 * len(plans) + 1.5), 3.6))
    axes = fig.subplots(1, len(plans), sharey=True, squeeze=False)[0]
    _draw_stage_memory(list(axes), plans, plan_names(plans, names))
    fig.suptitle("Stage memory M_j (params, grads, optimizer, stash, activations)")
    return fig


def _draw_step_times(ax: Axes, plans: Sequence[Plan], names: list[str]) -> None:
    """One horizontal bar per plan, fastest on top, labelled with its step and its ratio to the
    fastest feasible plan; an infeasible plan's bar is hatched and says so."""
    ok = [p.step_time_s for p in plans if p.feasible]
    best = min(ok) if ok else float("nan")
    order = sorted(range(len(plans)), key=lambda i: (not plans[i].feasible, plans[i].step_time_s))
    right = max(p.step_time_s for p in plans) * 1e3
    for row, i in enumerate(order):
        plan = plans[i]
        ms = plan.step_time_s * 1e3
        color = _PLAN_COLORS[i % len(_PLAN_COLORS)]
        (bar,) = ax.barh(row, ms, 0.7, color=color, hatch="" if plan.feasible else "//")
        bar.set_gid(f"step-time/{i}")
        if not plan.feasible:
            tag = "does not fit memory"
        elif plan.step_time_s == best and row == 0:
            tag = "best"
        else:
            tag = f"{plan.step_time_s / best:.2f}×"
        ax.text(
            ms + right * 0.01,
            row,
            f"{ms:.1f} ms  {tag}",
            va="center",
            fontsize=9,
            gid=f"step-label/{i}",
        )
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"{names[i]} (m={plans[i].microbatches})" for i in order])
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlim(0, right * 1.25)
    ax.set_xlabel("step time (ms)")
    ax.set_title("Step time per plan (what decides): its ratio to the fastest")


def _draw_stage_busy(ax: Axes, plans: Sequence[Plan], names: list[str]) -> None:
    """Each stage's busy time per step, m·t_j, plans side by side (so plans of different m
    compare), with each plan's step time dashed in its colour: the gap is the stage's idle time."""
    for i, (plan, name) in enumerate(zip(plans, names)):
        busy = np.array([s.time_s for s in plan.stages]) * plan.microbatches * 1e3
        bar, line = f"{name}: m·t_j (m={plan.microbatches})", f"{name}: step"
        gids = ("stage-busy", "step-line")
        _stage_bars(ax, i, len(plans), busy, plan.step_time_s * 1e3, gids, bar=bar, line=line)
    _stage_ticks(ax, plans)
    ax.set_ylabel("busy per step (ms)")
    ax.set_title("Busy time per step m·t_j; dashed: the plan's step, the gap is idle time")
    ax.set_ylim(0, max(p.step_time_s for p in plans) * 1e3 * 1.1)
    handles, labels = ax.get_legend_handles_labels()  # bars first, then the dashed steps
    pairs = sorted(zip(handles, labels), key=lambda hl: hl[1].endswith(": step"))
    ax.legend(*zip(*pairs), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def compare_figure(plans: Sequence[Plan], names: Sequence[str] | None = None) -> Figure:
    """Plans compared: step time per plan with its ratio to the fastest (top), each stage's busy
    time per step m·t_j against the plan's step (middle; plans of different m compare), and
    one memory panel per plan (bottom); every panel takes the plans fastest first, each in
    one colour throughout."""
    _check_plans(plans)
    labels = plan_names(plans, names)
    # one order in every panel: the step panel's, fastest feasible plan first
    order = sorted(range(len(plans)), key=lambda i: (not plans[i].feasible, plans[i].step_time_s))
    plans, labels = [plans[i] for i in order], [labels[i] for i in order]
    k = len(plans)
    fig = new_figure((max(10.0, 3.0 * k + 1.5), 8.0 + 0.25 * k))
    grid = fig.add_gridspec(3, k, height_ratios=[0.6 + 0.25 * k, 3.0, 3.0])
    _draw_step_times(fig.add_subplot(grid[0, :]), plans, labels)
    _draw_stage_busy(fig.add_subplot(grid[1, :]), plans, labels)
    first = fig.add_subplot(grid[2, 0])
    axes = [first] + [fig.add_subplot(grid[2, i], sharey=first) for i in range(1, k)]
    _draw_stage_memory(axes, plans, labels)
    return fig


# --------------------------------------------------------------------------------------------
# Micro-batch sweep
# --------------------------------------------------------------------------------------------


def microbatch_sweep(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions | None = None,
    ms: Sequence[int] | None = None,
    *,
    frame: pd.DataFrame | None = None,
    solver: Callable[[Profile, Cluster, PlanOptions], Plan] | None = None,
) -> Figure:
    """Step time (top) and bubble fraction (bottom) of the best plan at each micro-batch count.

    ``frame`` is :func:`pipeplan.report.frames.sweep_frame`'s table; without it each m is
    planned here with ``solver`` (:func:`pipeplan.solvers.dp.solve_dp`, say).  The top panel also draws the cost
    model's lower bound at each m; the bottom one GPipe's ideal bubble (p-1)/(m+p-1).  The
    dashed vertical line is the GPipe paper's rule of thumb m = 4p; infeasible m are crosses.
    """
    if frame is None:
        if solver is None:
            raise TypeError("microbatch_sweep needs frame= (sweep_frame's table) or solver=")
        frame = sweep_frame(profile, cluster, options, ms, solver=solver)
    df = frame
    p = cluster.n_stages
    fig = new_figure((8, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    ok = df[df["feasible"].astype(bool)]
    bad = df[~df["feasible"].astype(bool)]
    top.plot(
        ok["m"],
        ok["step_time_s"] * 1e3,
        "o-",
        color="#4C72B0",
        label="best plan (DP)",
        gid="step-time",
    )
    top.plot(
        df["m"],
        df["lower_bound_s"] * 1e3,
        "--",
        color="#999999",
        label="lower bound (perfect balance, free links)",
        gid="lower-bound",
    )
    if len(bad):
        top.plot(
            bad["m"],
            np.full(len(bad), 0.05),
            "x",
            color="#C44E52",
            markersize=9,
            transform=top.get_xaxis_transform(),
            label="does not fit memory",
            gid="infeasible",
        )
    best = df[df["best"]]
    if len(best):
        b = best.iloc[0]
        top.plot(
            [b["m"]],
            [b["step_time_s"] * 1e3],
            "*",
            color="#DD8452",
            markersize=16,
            label=f"best m = {int(b['m'])}",
            gid="best",
        )
    top.set_ylabel("step time (ms)")
    dense = np.geomspace(float(df["m"].min()), float(df["m"].max()), 200)
    bottom.plot(
        ok["m"], ok["bubble_fraction"], "o-", color="#4C72B0", label="best plan (DP)", gid="bubble"
    )
    bottom.plot(
        dense,
        [ideal_bubble(m, p) for m in dense],
        "--",
        color="#999999",
        label="ideal (p-1)/(m+p-1)",
        gid="ideal-bubble",
    )
    bottom.set_ylabel("bubble fraction")
    bottom.set_xlabel("micro-batches m")
    bottom.set_ylim(0, 1)
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.axvline(
            4 * p, color="#8172B2", linestyle=":", label="GPipe rule m = 4p", gid="rule-of-thumb"
        )
        ax.grid(color="#eeeeee")
        ax.legend(fontsize=8)
    bottom.set_xticks(list(df["m"]))
    bottom.set_xticklabels([str(int(m)) for m in df["m"]])
    limits = sorted({d.memory_bytes for d in cluster.devices})
    memory = "/".join(format_bytes(b) for b in limits)
    top.set_title(f"{profile.model}: p={p}, B={profile.batch_size}, memory {memory} per device")
    return fig


def device_frontier(plans: Sequence[Plan], devices: int | None = None) -> Figure:
    """Global samples per second against pipeline depth p, one point per plan (each plan's
    replicas d = ``plan.cluster.data_parallel``; throughput ``plan.throughput * d``), the best
    marked; and each plan's largest stage memory against the device's limit below.  Points
    carry gids ``"frontier/p"``; the best ``"frontier-best"``."""
    if not plans:
        raise ValueError("no plans to draw; pass the best plan of each depth")
    ps = np.array([p.n_stages for p in plans])
    rates = np.array([p.throughput * p.cluster.data_parallel for p in plans])
    mems = np.array([max(s.memory.total for s in p.stages) for p in plans], dtype=float)
    limit = float(plans[0].stages[0].memory_limit)
    scale, unit = _byte_scale(max(float(mems.max()), limit))
    fig = new_figure((7, 5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    order = np.argsort(ps)
    top.plot(ps[order], rates[order], "-", color="#4C72B0")
    for p, rate in zip(ps, rates):
        top.plot([p], [rate], "o", color="#4C72B0", gid=f"frontier/{p}")
    best = int(np.argmax(rates))
    top.plot([ps[best]], [rates[best]], "*", ms=16, color="#C44E52", gid="frontier-best",
             label=f"best: p = {ps[best]}, d = {plans[best].cluster.data_parallel}")  # fmt: skip
    n = devices or int(ps[best] * plans[best].cluster.data_parallel)
    top.set_ylabel("samples / s")
    top.set_title(f"{n} devices: pipeline depth p, data-parallel replicas {n} / p")
    top.legend(loc="best")
    bottom.bar(ps, mems / scale, 0.6, color="#55A868", label="largest stage")
    bottom.axhline(limit / scale, color="black", ls="--", label=f"limit {format_bytes(int(limit))}")
    bottom.set_ylabel(f"memory ({unit})")
    bottom.set_xlabel("pipeline stages p")
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(sorted(set(ps.tolist())), [str(v) for v in sorted(set(ps.tolist()))])
    bottom.legend(loc="best")
    return fig
