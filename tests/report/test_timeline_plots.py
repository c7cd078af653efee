"""Figures of pipeplan.report.timeline_plots and the frames of pipeplan.report.frames they draw."""

from __future__ import annotations

import pytest
from matplotlib.patches import Rectangle

from pipeplan.planner.replay import ChunkCosts, replay, replay_plan
from pipeplan.planner.types import RunReport, StageMeasurement
from pipeplan.report import frames, timeline_plots


def test_gantt_has_a_row_per_device_and_a_block_per_operation(plans, renders):
    plan = plans[0]
    p, m = plan.n_stages, plan.microbatches
    fig = timeline_plots.gantt(plan)
    (ax, *_) = fig.axes
    assert len(fig.axes) == 1
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        f"stage {j}\n{s.device}" for j, s in enumerate(plan.stages)
    ]
    rects = {r.get_gid() for r in ax.patches if isinstance(r, Rectangle)}
    for j in range(p):
        for i in range(m):
            assert f"forward/{j}/{i}" in rects
            assert f"backward/{j}/{i}" in rects
            if plan.stages[j].recompute:
                assert f"recompute/{j}/{i}" in rects
    # every micro-batch number is written on the widest blocks (the backward of the last stage)
    labels = [t.get_text() for t in ax.texts]
    assert all(labels.count(str(i)) >= 1 for i in range(m))
    title = ax.get_title()
    timeline = replay_plan(plan)
    assert f"step {timeline.makespan_s * 1e3:.2f} ms" in title
    work = sum(e.end_s - e.start_s for e in timeline.events)  # no tied weight: nothing waits
    assert f"bubble {1 - work / p / timeline.makespan_s:.1%}" in title
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"forward", "backward", "recompute", "idle (bubble)"} <= set(legend)
    renders(fig)


def test_gantt_blocks_sit_where_the_simulator_puts_them():
    costs = ChunkCosts([1e-3, 2e-3], [2e-3, 4e-3], [1e-3, 0.0])
    timeline = replay("1f1b", 2, 1, 3, costs)
    fig = timeline_plots.gantt(timeline, title="custom")
    ax = fig.axes[0]
    assert ax.get_title() == "custom"
    by_gid = {r.get_gid(): r for r in ax.patches}
    for e in timeline.events:
        r = by_gid[f"{e.kind}/{e.rank}/{e.microbatch}"]
        assert r.get_x() == pytest.approx(e.start_s * 1e3)
        assert r.get_width() == pytest.approx((e.end_s - e.start_s) * 1e3)
        assert r.get_y() + r.get_height() / 2 == pytest.approx(e.rank)
    assert "send/recv" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_gantt_rejects_other_input():
    with pytest.raises(TypeError, match="Plan or a Replay"):
        timeline_plots.gantt([1, 2])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------


def _report(plan, scale: float = 1.3) -> RunReport:
    """A hand-made run of ``plan``: every operation ``scale`` times slower than predicted."""
    timeline = replay_plan(plan)
    events = []
    for e in timeline.events:
        if e.kind in ("forward", "backward"):
            start = e.start_s * scale
            if e.kind == "backward" and plan.stages[e.rank].recompute:
                start -= plan.stages[e.rank].forward_s * scale  # the runtime times both as one
            events.append(
                {
                    "name": f"{e.kind[0].upper()}{e.microbatch}",
                    "kind": e.kind,
                    "stage": e.rank,
                    "microbatch": e.microbatch,
                    "start_s": start,
                    "end_s": e.end_s * scale,
                }
            )
    m = plan.microbatches
    stages = tuple(
        StageMeasurement(
            stage=s.index,
            forward_s=(s.forward_s * scale,) * m,
            backward_s=(s.backward_s * scale,) * m,
        )
        for s in plan.stages
    )
    return RunReport(
        plan_fingerprint=plan.fingerprint,
        model=plan.model,
        backend="gloo",
        world_size=plan.n_stages,
        steps=3,
        warmup_steps=1,
        step_times_s=(timeline.makespan_s * scale,) * 3,
        step_time_s=timeline.makespan_s * scale,
        predicted_step_time_s=plan.step_time_s,
        stages=stages,
        events=tuple(events),
    )


def test_report_frames(plans):
    plan = plans[0]
    report = _report(plan)
    df = frames.report_frame(report, plan)
    assert len(df) == plan.n_stages * plan.microbatches
    assert df["forward_ratio"].tolist() == pytest.approx([1.3] * len(df))
    assert df["backward_ratio"].tolist() == pytest.approx([1.3] * len(df))
    ev = frames.events_frame(report)
    assert list(ev.columns) == frames.EVENT_COLUMNS
    assert set(ev["kind"]) == {"forward", "backward"}
    assert len(ev) == 2 * plan.n_stages * plan.microbatches
    # older runtimes record names only
    named = report.model_copy(
        update={"events": tuple({k: v for k, v in e.items() if k != "kind"} for e in report.events)}
    )
    assert frames.events_frame(named)["kind"].tolist() == ev["kind"].tolist()
    with pytest.raises(ValueError, match="has 3 stages but the plan has 4"):
        frames.report_frame(report, plans[1])


def test_measured_vs_simulated_share_the_time_axis(plans, renders):
    plan = plans[0]
    report = _report(plan)
    fig = timeline_plots.measured_vs_simulated(report, plan)
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_title().startswith("measured (last of 3 steps): step")
    assert bottom.get_title().startswith("simulated: step")
    assert top.get_xlim() == bottom.get_xlim()
    measured = {r.get_gid() for r in top.patches}
    assert len(measured) == 2 * plan.n_stages * plan.microbatches
    ratio = report.step_time_s / report.predicted_step_time_s
    assert f"({ratio:.2f}x)" in fig.get_suptitle()
    renders(fig)
    with pytest.raises(ValueError, match="pass the plan file the run executed"):
        timeline_plots.measured_vs_simulated(report, plans[1])


def test_gantt_tells_waiting_at_the_tied_all_reduce_from_its_work():
    """Stage 1 finishes its backwards 1 ms before stage 0: that 1 ms is drawn as waiting
    (light, hatched), and only the all-reduce's own 0.5 ms as the tied block on both."""
    costs = ChunkCosts([1e-3, 1e-3], [1e-3, 3e-3], [0.0, 0.0])
    fig = timeline_plots.gantt(replay("gpipe", 2, 1, 1, costs, syncs=[((0, 1), 0.5e-3)]))
    ax = fig.axes[0]
    by_gid = {r.get_gid(): r for r in ax.patches}
    wait, tied = by_gid["wait/1/-1"], by_gid["tied/1/-1"]
    assert (wait.get_x(), wait.get_width()) == pytest.approx((5.0, 1.0))
    assert (tied.get_x(), tied.get_width()) == pytest.approx((6.0, 0.5))
    assert by_gid["tied/0/-1"].get_width() == pytest.approx(0.5) and "wait/0/-1" not in by_gid
    assert wait.get_hatch() and wait.get_facecolor() != tied.get_facecolor()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "waiting for the others" in legend
    busy = (1 + 1 + 1 + 3 + 2 * 0.5) / 2  # F, B and the all-reduce per device, ms
    assert f"bubble {1 - busy / 6.5:.1%}" in ax.get_title()


def test_split_waits_leaves_events_without_collectives_alone():
    timeline = replay("gpipe", 2, 1, 2, ChunkCosts([1e-3, 2e-3], [2e-3, 4e-3], [0.0, 0.0]))
    df = frames.timeline_frame(timeline)
    assert frames.split_waits(df).equals(df)


def test_gantt_labels_each_block_with_its_chunk_where_a_rank_runs_several():
    """A V (ZB-V, p = 2, v = 2): rank 0 runs chunks 0 and 3, so its blocks read ``c0:k`` and
    ``c3:k``; a one-chunk plan's read the micro-batch alone."""
    costs = ChunkCosts([1.0] * 4, [2.0] * 4, [0.0] * 4, [1.0] * 4, [1.0] * 4)
    labels = {
        t.get_text() for t in timeline_plots.gantt(replay("zbv", 2, 2, 2, costs)).axes[0].texts
    }
    assert {"c0:0", "c3:0", "c1:1", "c2:1"} <= labels
    one = ChunkCosts([1.0, 1.0], [2.0, 2.0], [0.0, 0.0])
    assert {
        t.get_text() for t in timeline_plots.gantt(replay("gpipe", 2, 1, 2, one)).axes[0].texts
    } == {"0", "1"}
