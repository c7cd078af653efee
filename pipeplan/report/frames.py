"""DataFrames of timelines, run reports and micro-batch sweeps, for notebooks and plots.

``Plan.to_frame()`` and ``Profile.to_frame()`` live with their types; this module adds the
frames that need more than one object or a computation:

    timeline_frame(replay)        one row per simulated event
    split_waits(events)           a collective's span cut into waiting and work
    events_frame(report)          one row per measured event of a run's last step
    report_frame(report, plan)    one row per (stage, micro-batch): measured vs predicted times
    sweep_frame(profile, ...)     one row per micro-batch count m: the best plan at that m

Every frame of events has the columns ``stage, microbatch, kind, start_s, end_s, duration_s``,
so a measured and a simulated step are drawn by the same code (:mod:`pipeplan.report.timeline_plots`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd

from pipeplan.planner.costmodel import lower_bound
from pipeplan.planner.errors import InfeasiblePlanError
from pipeplan.planner.replay import Replay
from pipeplan.planner.types import Cluster, Plan, PlanOptions, Profile, RunReport
from pipeplan.planner.unitcosts import microbatch_choices

__all__ = [
    "EVENT_COLUMNS",
    "events_frame",
    "ideal_bubble",
    "report_frame",
    "split_waits",
    "sweep_frame",
    "timeline_frame",
]

#: Kinds of event that several stages run together (all-reduces): each member's span starts
#: when it arrives and ends when the last member's work does.
COLLECTIVES = ("tied",)

EVENT_COLUMNS = ["stage", "microbatch", "kind", "start_s", "end_s", "chunk", "duration_s"]
"""``stage`` is the row: the rank (device) that ran the event; ``chunk`` the plan's stage it
belongs to (equal to ``stage`` for one chunk per rank; -1 for a rank-wide event)."""

_KIND_BY_INITIAL = {"F": "forward", "B": "backward", "R": "recompute", "S": "send"}


def timeline_frame(replay: Replay) -> pd.DataFrame:
    """One row per event of a simulated step, ordered by row (the rank, as a run records it:
    ``stage``) and start time.

    >>> from pipeplan.planner.replay import ChunkCosts, replay
    >>> costs = ChunkCosts([1.0, 1.0], [2.0, 2.0], [0.0, 0.0])
    >>> timeline_frame(replay("gpipe", 2, 1, 2, costs)).shape
    (8, 7)
    """
    rows = [(e.rank, e.microbatch, e.kind, e.start_s, e.end_s, e.stage) for e in replay.events]
    return _finish(pd.DataFrame(rows, columns=EVENT_COLUMNS[:-1]))


def events_frame(report: RunReport) -> pd.DataFrame:
    """One row per measured event of the report's last step (times relative to its start).

    An event's kind is its ``kind`` field, or read from its name (``F3`` = forward of
    micro-batch 3, ``B3`` = backward) for runtimes that record names only.
    """
    rows = []
    for e in report.events:
        name = str(e.get("name", ""))
        kind = str(e.get("kind") or _KIND_BY_INITIAL.get(name[:1], name or "other"))
        rows.append(
            (
                int(e["stage"]),
                int(e.get("microbatch", -1)),
                kind,
                float(e["start_s"]),
                float(e["end_s"]),
                int(e.get("chunk", e["stage"])),
            )
        )
    return _finish(pd.DataFrame(rows, columns=EVENT_COLUMNS[:-1]))


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    df["duration_s"] = df["end_s"] - df["start_s"]
    return df.sort_values(["stage", "start_s"], kind="stable").reset_index(drop=True)


def split_waits(events: pd.DataFrame, collectives: Sequence[str] = COLLECTIVES) -> pd.DataFrame:
    """``events`` with each collective's span cut in two: ``wait`` while a member waits for
    the last one to arrive, then the collective itself from that arrival to the end.

    The members of one collective are its kind's events that end at the same time (to 1 us).
    Everything else is returned unchanged, as are the spans of a collective whose members all
    arrive together.

    >>> from pipeplan.planner.replay import ChunkCosts, replay
    >>> t = replay("gpipe", 2, 1, 1, ChunkCosts([1.0, 1.0], [1.0, 3.0], [0.0, 0.0]),
    ...            syncs=[((0, 1), 0.5)])
    >>> df = split_waits(timeline_frame(t)).query("microbatch < 0")
    >>> list(zip(df["stage"], df["kind"], df["start_s"], df["end_s"]))
    [(0, 'tied', 6.0, 6.5), (1, 'wait', 5.0, 6.0), (1, 'tied', 6.0, 6.5)]
    """
    is_collective = events["kind"].isin(list(collectives))
    spans = events[is_collective]
    begin = spans.groupby([spans["kind"], spans["end_s"].round(6)])["start_s"].transform("max")
    early = spans["start_s"] < begin
    waits = spans[early].assign(kind="wait", end_s=begin[early])
    work = spans.assign(start_s=begin)
    parts = [frame for frame in (events[~is_collective], waits, work) if len(frame)]
    if not parts:
        return events.copy()
    return _finish(pd.concat(parts).drop(columns="duration_s"))


def report_frame(report: RunReport, plan: Plan | None = None) -> pd.DataFrame:
    """One row per (stage, micro-batch) with the measured forward and backward seconds.

    With ``plan``, adds the cost model's per-micro-batch ``predicted_forward_s`` and
    ``predicted_backward_s`` (backward includes recompute, as in the runtime's measurement)
    and their ratios ``forward_ratio`` / ``backward_ratio`` = measured / predicted.
    """
    if plan is not None and len(plan.stages) != len(report.stages):
        raise ValueError(
            f"the report has {len(report.stages)} stages but the plan has {len(plan.stages)}; "
            f"pass the plan the run executed"
        )
    rows = []
    for s in report.stages:
        for i, (fwd, bwd) in enumerate(zip(s.forward_s, s.backward_s)):
            row: dict[str, float | int] = {
                "stage": s.stage,
                "microbatch": i,
                "forward_s": fwd,
                "backward_s": bwd,
            }
            if plan is not None:
                st = plan.stages[s.stage]
                row["predicted_forward_s"] = st.forward_s
                row["predicted_backward_s"] = st.backward_s
                row["forward_ratio"] = fwd / st.forward_s if st.forward_s else float("nan")
                row["backward_ratio"] = bwd / st.backward_s if st.backward_s else float("nan")
            rows.append(row)
    return pd.DataFrame(rows)


def ideal_bubble(m: float, p: int) -> float:
    """GPipe's bubble with perfectly balanced stages: (p - 1) / (m + p - 1).

    >>> ideal_bubble(4, 2)
    0.2
    """
    return (p - 1) / (m + p - 1)


def sweep_frame(
    profile: Profile,
    cluster: Cluster,
    options: PlanOptions | None = None,
    ms: Sequence[int] | None = None,
    *,
    solver: Callable[[Profile, Cluster, PlanOptions], Plan],
) -> pd.DataFrame:
    """The best plan at each fixed micro-batch count m: one row per m.

    ``ms`` defaults to every m whose micro-batch size B/m was profiled; ``solver`` plans one m
    (:func:`pipeplan.solvers.dp.solve_dp`, say: the planner does not import the solvers).  Columns: ``m, microbatch_size, feasible, step_time_s,
    bubble_fraction, ideal_bubble, lower_bound_s, throughput, max_memory_bytes, boundaries,
    best`` (the fastest feasible m).  An m at which nothing fits memory has ``feasible`` False
    and NaN times.
    """
    options = options or PlanOptions()
    if ms is None:
        ms = microbatch_choices(profile, options.model_copy(update={"microbatches": None}))
    p = cluster.n_stages
    rows = []
    for m in ms:
        opts = options.model_copy(update={"microbatches": int(m)})
        row: dict[str, object] = {
            "m": int(m),
            "microbatch_size": profile.batch_size // int(m),
            "feasible": False,
            "step_time_s": float("nan"),
            "bubble_fraction": float("nan"),
            "ideal_bubble": ideal_bubble(int(m), p),
            "lower_bound_s": lower_bound(profile, cluster, opts),
            "throughput": float("nan"),
            "max_memory_bytes": float("nan"),
            "boundaries": None,
        }
        try:
            plan = solver(profile, cluster, opts)
        except InfeasiblePlanError:
            rows.append(row)
            continue
        row.update(
            feasible=plan.feasible,
            step_time_s=plan.step_time_s,
            bubble_fraction=plan.bubble_fraction,
            throughput=plan.throughput,
            max_memory_bytes=max(s.memory.total for s in plan.stages),
            boundaries=plan.boundaries,
        )
        rows.append(row)
    df = pd.DataFrame(rows)
    ok = df["feasible"].astype(bool)
    df["best"] = False
    if ok.any():
        df.loc[df.loc[ok, "step_time_s"].astype(float).idxmin(), "best"] = True
    return df
