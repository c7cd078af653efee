"""Figures of planner.plots and frames of planner.frames: open them and check what they draw."""

from __future__ import annotations

import io

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from planner import frames, plots
from planner.costmodel import evaluate
from planner.simulate import simulate, simulate_plan
from planner.synthetic import synthetic_profile
from planner.types import Cluster, Device, PlanOptions, RunReport, StageMeasurement
from solvers.dp import solve_dp

MiB = 2**20


@pytest.fixture(scope="module")
def profile():
    return synthetic_profile(12, batch_size=16, seed=3, heavy_ends=True)


@pytest.fixture(scope="module")
def plans(profile):
    """A DP plan with 3 stages and a uniform 4-stage split that overflows a small device."""
    dp = solve_dp(profile, Cluster.homogeneous(3, 512 * MiB), PlanOptions(microbatches=4))
    small = Cluster(
        devices=tuple(Device(name=f"d{j}", memory_bytes=(12 + j) * MiB) for j in range(4))
    )
    uniform = evaluate(profile, small, PlanOptions(), [3, 6, 9], 4, solver="uniform")
    return [dp, uniform]


def _texts(fig: Figure) -> list[str]:
    out = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    return [t for t in out if t]


def _gids(ax, prefix: str) -> list[str]:
    return [a.get_gid() for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def _renders(fig: Figure) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------


def test_gantt_has_a_row_per_device_and_a_block_per_operation(plans):
    plan = plans[0]
    p, m = plan.n_stages, plan.microbatches
    fig = plots.gantt(plan)
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
    timeline = simulate_plan(plan)
    assert f"step {timeline.makespan_s * 1e3:.2f} ms" in title
    assert f"bubble {timeline.bubble_fraction:.1%}" in title
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"forward", "backward", "recompute", "idle (bubble)"} <= set(legend)
    _renders(fig)


def test_gantt_blocks_sit_where_the_simulator_puts_them():
    timeline = simulate([1e-3, 2e-3], [2e-3, 4e-3], [1e-3, 0.0], 3, schedule="1f1b")
    fig = plots.gantt(timeline, title="custom")
    ax = fig.axes[0]
    assert ax.get_title() == "custom"
    by_gid = {r.get_gid(): r for r in ax.patches}
    for e in timeline.events:
        r = by_gid[f"{e.kind}/{e.stage}/{e.microbatch}"]
        assert r.get_x() == pytest.approx(e.start_s * 1e3)
        assert r.get_width() == pytest.approx((e.end_s - e.start_s) * 1e3)
        assert r.get_y() + r.get_height() / 2 == pytest.approx(e.stage)
    assert "send/recv" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_gantt_rejects_other_input():
    with pytest.raises(TypeError, match="Plan or a Timeline"):
        plots.gantt([1, 2])  # type: ignore[arg-type]


def test_stage_times_draws_one_bar_per_stage_and_marks_the_slowest(plans):
    fig = plots.stage_times(plans, names=["dp", "uniform"])
    (ax,) = fig.axes
    bars = _gids(ax, "stage-time/")
    assert len(bars) == sum(p.n_stages for p in plans) == 7
    heights = {r.get_gid(): r.get_height() for r in ax.patches}
    for i, plan in enumerate(plans):
        for j, s in enumerate(plan.stages):
            assert heights[f"stage-time/{i}/{j}"] == pytest.approx(s.time_s * 1e3)
        (marker,) = [ln for ln in ax.lines if ln.get_gid() == f"slowest/{i}"]
        assert marker.get_ydata()[0] == pytest.approx(max(s.time_s for s in plan.stages) * 1e3)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == ["dp", "slowest stage", "uniform"]
    _renders(fig)


def test_stage_memory_stacks_the_breakdown_under_each_limit(plans):
    fig = plots.stage_memory(plans)
    assert len(fig.axes) == len(plans)
    for ax, plan in zip(fig.axes, plans):
        assert ax.get_title() == f"{plan.solver} p={plan.n_stages} m={plan.microbatches}"
        tops = {}
        for r in ax.patches:
            j = int(r.get_gid().rsplit("/", 1)[1])
            tops[j] = max(tops.get(j, 0.0), r.get_y() + r.get_height())
        assert len(ax.patches) == 5 * plan.n_stages
        (limits,) = [c for c in ax.collections if c.get_gid() == "memory-limit"]
        assert isinstance(limits, LineCollection)
        ys = [seg[0][1] for seg in limits.get_segments()]
        assert ys == pytest.approx([s.memory_limit / MiB for s in plan.stages])
        assert [tops[j] for j in range(plan.n_stages)] == pytest.approx(
            [s.memory.total / MiB for s in plan.stages]
        )
    assert fig.axes[0].get_ylabel() == "memory (MiB)"
    # the uniform split overflows: the over-limit stages are flagged
    over = [t for t in fig.axes[1].texts if t.get_text() == "over"]
    assert len(over) == sum(not s.feasible for s in plans[1].stages) > 0
    legend = {t.get_text() for t in fig.axes[-1].get_legend().get_texts()}
    assert legend == {
        "params",
        "grads",
        "optimizer",
        "stashed inputs",
        "activations",
        "device limit",
    }


def test_compare_figure_combines_times_and_memory(plans):
    fig = plots.compare_figure(plans)
    assert len(fig.axes) == 1 + len(plans)
    assert len(_gids(fig.axes[0], "stage-time/")) == 7
    assert all(any(c.get_gid() == "memory-limit" for c in ax.collections) for ax in fig.axes[1:])
    _renders(fig)


def test_plot_inputs_are_checked(plans):
    with pytest.raises(ValueError, match="1 names for 2 plans"):
        plots.stage_times(plans, names=["one"])
    with pytest.raises(ValueError, match="no plans"):
        plots.stage_memory([])
    with pytest.raises(TypeError, match="list of plans"):
        plots.stage_times(plans[0])  # type: ignore[arg-type]
    assert plots.plan_names([plans[0], plans[0]]) == ["dp p=3 m=4 #0", "dp p=3 m=4 #1"]


def test_microbatch_sweep_has_a_point_per_m_and_the_ideal_curve(profile):
    cluster = Cluster.homogeneous(3, 512 * MiB)
    df = frames.sweep_frame(profile, cluster, PlanOptions())
    assert list(df["m"]) == [1, 2, 4, 8, 16]
    assert df["best"].sum() == 1
    assert df.loc[df["best"], "step_time_s"].item() == pytest.approx(df["step_time_s"].min())
    assert df["ideal_bubble"].tolist() == pytest.approx([2 / (m + 2) for m in df["m"]])
    fig = plots.microbatch_sweep(profile, cluster, PlanOptions(), frame=df)
    _, bottom = fig.axes
    lines = {ln.get_gid(): ln for ax in fig.axes for ln in ax.lines}
    assert list(lines["step-time"].get_xdata()) == [1, 2, 4, 8, 16]
    assert list(lines["step-time"].get_ydata()) == pytest.approx(df["step_time_s"] * 1e3)
    ideal = lines["ideal-bubble"]
    x, y = np.asarray(ideal.get_xdata()), np.asarray(ideal.get_ydata())
    assert y == pytest.approx(2 / (x + 2))
    assert lines["rule-of-thumb"].get_xdata()[0] == 12
    assert lines["best"].get_xdata()[0] == df.loc[df["best"], "m"].item()
    assert bottom.get_xlabel() == "micro-batches m"
    _renders(fig)


def test_microbatch_sweep_marks_infeasible_m(profile):
    """When every stage recomputes, large micro-batches (small m) need the most memory."""
    always = PlanOptions(checkpoint="always")
    cluster = Cluster.homogeneous(3, 30 * MiB)  # m = 4 and 16 fit; m = 1 needs more
    df = frames.sweep_frame(profile, cluster, always, [1, 4, 16])
    assert df.loc[df["m"] == 16, "feasible"].item()
    assert not df.loc[df["m"] == 1, "feasible"].item()
    assert np.isnan(df.loc[df["m"] == 1, "step_time_s"].item())
    fig = plots.microbatch_sweep(profile, cluster, frame=df)
    crosses = [ln for ln in fig.axes[0].lines if ln.get_gid() == "infeasible"]
    assert list(crosses[0].get_xdata()) == list(df.loc[~df["feasible"], "m"])


# --------------------------------------------------------------------------------------------


def _report(plan, scale: float = 1.3) -> RunReport:
    """A hand-made run of ``plan``: every operation ``scale`` times slower than predicted."""
    timeline = simulate_plan(plan)
    events = []
    for e in timeline.events:
        if e.kind in ("forward", "backward"):
            start = e.start_s * scale
            if e.kind == "backward" and plan.stages[e.stage].recompute:
                start -= plan.stages[e.stage].forward_s * scale  # the runtime times both as one
            events.append(
                {
                    "name": f"{e.kind[0].upper()}{e.microbatch}",
                    "kind": e.kind,
                    "stage": e.stage,
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


def test_measured_vs_simulated_share_the_time_axis(plans):
    plan = plans[0]
    report = _report(plan)
    fig = plots.measured_vs_simulated(report, plan)
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_title().startswith("measured (last of 3 steps): step")
    assert bottom.get_title().startswith("simulated: step")
    assert top.get_xlim() == bottom.get_xlim()
    measured = {r.get_gid() for r in top.patches}
    assert len(measured) == 2 * plan.n_stages * plan.microbatches
    ratio = report.step_time_s / report.predicted_step_time_s
    assert f"({ratio:.2f}x)" in fig.get_suptitle()
    _renders(fig)
    with pytest.raises(ValueError, match="pass the plan file the run executed"):
        plots.measured_vs_simulated(report, plans[1])


def test_figures_leave_pyplot_alone(plans):
    """The module draws on its own Agg canvases: no backend switch, no pyplot figure left open."""
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    before = plt.get_fignums()
    fig = plots.gantt(plans[0])
    assert matplotlib.get_backend() == backend
    assert plt.get_fignums() == before
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"


def test_compare_cli_draws_the_comparison(plans, tmp_path, capsys):
    """`pipeplan compare a.json b.json --plot out.png`; a bad suffix is one line and exit 2."""
    from planner.cli import main
    from planner.io import write_json

    files = []
    for name, plan in zip(("dp", "uniform"), plans):
        files.append(str(tmp_path / f"{name}.json"))
        write_json(files[-1], plan)

    def run(*extra: str) -> int:
        try:
            main(["compare", *files, "--format", "csv", *extra])
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    image = tmp_path / "cmp.png"
    assert run("--plot", str(image)) == 0
    out, err = capsys.readouterr()
    assert out.startswith("name,") and f"figure -> {image}" in err
    assert image.read_bytes()[:4] == b"\x89PNG"
    assert run("--plot", str(tmp_path / "cmp.gif")) == 2
    _, err = capsys.readouterr()
    assert "must end in .png, .svg or .pdf" in err and not (tmp_path / "cmp.gif").exists()
