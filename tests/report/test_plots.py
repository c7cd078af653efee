"""Figures of pipeplan.report.plots (plan comparisons): open them and check what they draw."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.report import frames, plots
from pipeplan.solvers.dp import solve_dp

MiB = 2**20


def _texts(fig: Figure) -> list[str]:
    out = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    return [t for t in out if t]


def _gids(ax, prefix: str) -> list[str]:
    return [a.get_gid() for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


# --------------------------------------------------------------------------------------------


def test_stage_times_draws_one_bar_per_stage_and_marks_the_slowest(plans, renders):
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
    assert legend[0::2][:2] == ["dp", "uniform"] and legend[-1] == "slowest stage"
    renders(fig)


def test_perfect_balance_is_a_dashed_line_per_plan_named_in_the_legend(plans):
    """Each plan's mean stage time is a dashed line in its colour, its value in the legend."""
    fig = plots.stage_times(plans, names=["dp", "uniform"])
    (ax,) = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    for i, (plan, name) in enumerate(zip(plans, ["dp", "uniform"])):
        mean_ms = sum(s.time_s for s in plan.stages) / plan.n_stages * 1e3
        (line,) = [c for c in ax.collections if c.get_gid() == f"mean-time/{i}"]
        (segment,) = line.get_segments()
        assert segment[0][1] == segment[1][1] == pytest.approx(mean_ms)
        assert line.get_linestyle()[0][1] is not None  # dashed, not solid
        assert legend[2 * i + 1] == f"{name}: perfect balance {mean_ms:.3g} ms"


def test_stage_memory_stacks_the_breakdown_under_each_limit(plans):
    fig = plots.stage_memory(plans)
    assert len(fig.axes) == len(plans)
    for ax, plan in zip(fig.axes, plans):
        assert ax.get_title() == f"{plan.solver} p={plan.n_stages} m={plan.microbatches}"
        tops = {}
        for r in ax.patches:
            j = int(r.get_gid().rsplit("/", 1)[1])
            tops[j] = max(tops.get(j, 0.0), r.get_y() + r.get_height())
        assert len(ax.patches) == 8 * plan.n_stages  # one bar per part of the breakdown
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
    # the two plans' devices have different limits: each stage says its own, in MiB
    labels = [
        t.get_text() for t in fig.axes[1].texts if (t.get_gid() or "").startswith("memory-limit")
    ]
    assert labels == [f"limit {12 + j}.00 MiB" for j in range(4)]
    legend = {t.get_text() for t in fig.axes[-1].get_legend().get_texts()}
    assert legend == {
        "params",
        "grads",
        "optimizer",
        "inputs",
        "activations",
        "gradient buffers",
        "outputs",
        "working gradients",
        "device limit",
    }


@pytest.mark.parametrize(
    ("limit", "unit"), [(int(11.8 * 2**30), "GiB"), (3 * 2**40, "TiB"), (300 * MiB, "MiB")]
)
def test_memory_sizes_are_in_human_units(profile, limit, unit):
    """Sizes read "limit 11.80 GiB", never "1.21e+04 MiB": legend, axis and above the axis."""
    plan = solve_dp(profile, Cluster.homogeneous(3, limit), PlanOptions(microbatches=4))
    fig = plots.compare_figure([plan])
    texts = _texts(fig) + [t.get_text() for t in fig.axes[2].get_yticklabels()]
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert f"limit {format_bytes(limit)}" in legend and unit in format_bytes(limit)
    assert fig.axes[2].get_ylabel() in {"memory (MiB)", "memory (GiB)"}
    assert not [t for t in texts if "e+" in t or "e-" in t]
    if max(s.memory.total for s in plan.stages) * 1.5 < limit:  # above the axis: an arrow
        arrows = [t.get_text() for t in fig.axes[2].texts if t.get_text().endswith("↑")]
        assert arrows == [f"limit {format_bytes(limit)} ↑"]  # once: every stage has it


def test_compare_figure_leads_with_step_times_and_draws_busy_time_per_step(plans, renders):
    """Plans of different m compare: the top panel is each plan's step, labelled with its
    ratio to the fastest feasible plan; the middle one m·t_j per stage under each plan's step;
    the memory panels stay."""
    fig = plots.compare_figure(plans, names=["dp", "uniform"])
    assert len(fig.axes) == 2 + len(plans)
    step, busy = fig.axes[:2]
    feasible = [p.step_time_s for p in plans if p.feasible]
    order = sorted(range(len(plans)), key=lambda i: (not plans[i].feasible, plans[i].step_time_s))
    for i, plan in enumerate(plans[k] for k in order):
        (bar,) = [r for r in step.patches if r.get_gid() == f"step-time/{i}"]
        assert bar.get_width() == pytest.approx(plan.step_time_s * 1e3)
        (label,) = [t.get_text() for t in step.texts if t.get_gid() == f"step-label/{i}"]
        assert label.startswith(f"{plan.step_time_s * 1e3:.1f} ms")
        if not plan.feasible:
            assert label.endswith("does not fit memory")
        elif plan.step_time_s == min(feasible):
            assert label.endswith("best")
        heights = {r.get_gid(): r.get_height() for r in busy.patches}
        for j, s in enumerate(plan.stages):
            assert heights[f"stage-busy/{i}/{j}"] == pytest.approx(
                s.time_s * plan.microbatches * 1e3
            )
        (line,) = [c for c in busy.collections if c.get_gid() == f"step-line/{i}"]
        assert line.get_segments()[0][0][1] == pytest.approx(plan.step_time_s * 1e3)
    assert all(any(c.get_gid() == "memory-limit" for c in ax.collections) for ax in fig.axes[2:])
    renders(fig)


def test_compare_figure_ratios_hold_across_micro_batch_counts(profile):
    """m = 2, 4 and 8 of one split: the step bars carry the ratios, fastest on top."""
    cluster = Cluster.homogeneous(3, 2**40)
    runs = [solve_dp(profile, cluster, PlanOptions(microbatches=m)) for m in (2, 4, 8)]
    fig = plots.compare_figure(runs, names=["m2", "m4", "m8"])
    step = fig.axes[0]
    best = min(p.step_time_s for p in runs)
    order = sorted(range(3), key=lambda i: runs[i].step_time_s)
    ticks = [t.get_text() for t in step.get_yticklabels()]
    assert ticks == [f"m{2 ** (i + 1)} (m={2 ** (i + 1)})" for i in order]
    # every panel takes the plans in the step panel's order: gid k is the k-th fastest
    assert [ax.get_title() for ax in fig.axes[2:]] == [f"m{2 ** (i + 1)}" for i in order]
    for i, plan in enumerate(runs[k] for k in order):
        (label,) = [t.get_text() for t in step.texts if t.get_gid() == f"step-label/{i}"]
        tag = "best" if i == 0 else f"{plan.step_time_s / best:.2f}×"
        assert label == f"{plan.step_time_s * 1e3:.1f} ms  {tag}"
        busy = [r for r in fig.axes[1].patches if r.get_gid().startswith(f"stage-busy/{i}/")]
        assert sum(r.get_height() for r in busy) == pytest.approx(
            plan.microbatches * sum(s.time_s for s in plan.stages) * 1e3
        )


def test_plot_inputs_are_checked(plans):
    with pytest.raises(ValueError, match="1 names for 2 plans"):
        plots.stage_times(plans, names=["one"])
    with pytest.raises(ValueError, match="no plans"):
        plots.stage_memory([])
    with pytest.raises(TypeError, match="list of plans"):
        plots.stage_times(plans[0])  # type: ignore[arg-type]
    assert plots.plan_names([plans[0], plans[0]]) == ["dp p=3 m=4 #0", "dp p=3 m=4 #1"]


def test_microbatch_sweep_has_a_point_per_m_and_the_ideal_curve(profile, renders):
    cluster = Cluster.homogeneous(3, 512 * MiB)
    df = frames.sweep_frame(profile, cluster, PlanOptions(), solver=solve_dp)
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
    renders(fig)


def test_microbatch_sweep_marks_infeasible_m(profile):
    """When every stage recomputes, large micro-batches (small m) need the most memory."""
    always = PlanOptions(checkpoint="always")
    cluster = Cluster.homogeneous(3, 30 * MiB)  # m = 4 and 16 fit; m = 1 needs more
    df = frames.sweep_frame(profile, cluster, always, [1, 4, 16], solver=solve_dp)
    assert df.loc[df["m"] == 16, "feasible"].item()
    assert not df.loc[df["m"] == 1, "feasible"].item()
    assert np.isnan(df.loc[df["m"] == 1, "step_time_s"].item())
    fig = plots.microbatch_sweep(profile, cluster, frame=df)
    crosses = [ln for ln in fig.axes[0].lines if ln.get_gid() == "infeasible"]
    assert list(crosses[0].get_xdata()) == list(df.loc[~df["feasible"], "m"])


def test_compare_cli_draws_the_comparison(plans, tmp_path, capsys):
    """`pipeplan compare a.json b.json --plot out.png`; a bad suffix is one line and exit 2."""
    from pipeplan.cli import main
    from pipeplan.planner.io import write_json

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


def test_device_frontier_marks_the_best_depth() -> None:
    from pipeplan.planner.evaluate import evaluate
    from pipeplan.profiler.synthetic import synthetic_profile
    from pipeplan.solvers.devices import replica_profile

    prof = synthetic_profile(6, batch_size=8, microbatch_sizes=[1, 2, 4, 8], seed=2)
    plans = []
    for p, d in ((1, 4), (2, 2), (4, 1)):
        share = replica_profile(prof, d)
        clus = Cluster.homogeneous(p, 2**30).model_copy(update={"data_parallel": d})
        plans.append(evaluate(share, clus, PlanOptions(), list(range(1, p)), 2, solver="t"))
    fig = plots.device_frontier(plans)
    top, bottom = fig.axes
    best = [line for line in top.lines if line.get_gid() == "frontier-best"]
    rates = [pl.throughput * pl.cluster.data_parallel for pl in plans]
    want = plans[rates.index(max(rates))]
    assert len(best) == 1 and best[0].get_xdata()[0] == want.n_stages
    assert {line.get_gid() for line in top.lines} >= {"frontier/1", "frontier/2", "frontier/4"}
    assert "4 devices" in top.get_title()
    assert "limit 1.00 GiB" in [t.get_text() for t in bottom.get_legend().get_texts()]
    with pytest.raises(ValueError, match="no plans"):
        plots.device_frontier([])


def test_working_gradients_are_not_drawn_in_the_limit_lines_colour(plans):
    fig = plots.compare_figure(plans)
    memory = fig.axes[2]
    (limit,) = [c for c in memory.collections if c.get_gid() == "memory-limit"]
    working = [r for r in memory.patches if r.get_gid().startswith("memory/transient/")]
    assert working and all(tuple(r.get_facecolor()) != tuple(limit.get_color()[0]) for r in working)
