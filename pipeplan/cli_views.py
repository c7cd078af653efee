"""The ``pipeplan`` commands that read files and print them: ``show`` and ``compare``.

    pipeplan show FILE                       # a plan, profile, cluster or run report as tables
    pipeplan show PLAN --critical-path       # the chain of actions that sets the step
    pipeplan show PLAN --timeline            # each rank's actions: rank 0: F0 F1 B0 B1
    pipeplan compare PLAN... [--stages] [--format F] [-o FILE] [--plot FIG]

``pipeplan.cli`` registers them on its app; they import what they use inside their functions,
so ``pipeplan --help`` does not pay for pandas or torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.cli_options import check_output, fail

__all__ = ["compare", "show"]


def show(
    file: Annotated[Path, typer.Argument(help="A plan, profile, cluster or run report.")],
    plan_file: Annotated[
        Path | None,
        typer.Option(
            "--plan", help="With a run report: the plan that ran (measured vs predicted)."
        ),
    ] = None,
    critical_path: Annotated[
        bool,
        typer.Option(
            "--critical-path",
            help="With a plan: the chain of actions that sets its step, and the stage that "
            "sets the pace.",
        ),
    ] = False,
    timeline: Annotated[
        bool,
        typer.Option("--timeline", help="With a plan: each rank's actions, in order, as text."),
    ] = False,
) -> None:
    """Print a plan, profile, cluster or run report as tables."""
    from pipeplan import api
    from pipeplan.planner.types import Cluster, Plan, Profile, RunReport
    from pipeplan.report.summaries import cluster_tables, report_tables
    from pipeplan.report.terminal import console, print_plan, print_profile

    obj = api.load(file)
    if plan_file is not None and not isinstance(obj, RunReport):
        fail(f"--plan goes with a run report; {file} is not one")
    if (critical_path or timeline) and not isinstance(obj, Plan):
        flag = "--critical-path" if critical_path else "--timeline"
        fail(f"{flag} goes with a plan; {file} is not one")
    if isinstance(obj, Plan) and (critical_path or timeline):
        from pipeplan.report import critical_path as cp

        if critical_path:
            console.print(cp.path_table(cp.critical_path(obj)), highlight=False)
        if timeline:
            console.print("\n".join(cp.rank_lines(obj)), highlight=False, soft_wrap=True)
    elif isinstance(obj, Plan):
        print_plan(obj)
    elif isinstance(obj, Profile):
        print_profile(obj)
    elif isinstance(obj, Cluster):
        for part in cluster_tables(obj):
            console.print(part, highlight=False)
    elif isinstance(obj, RunReport):
        from pipeplan.runtime.records import measured_bubble, print_comparison

        if plan_file is None:
            for part in report_tables(obj, measured_bubble(obj)):
                console.print(part, highlight=False)
            return
        plan = api.load(plan_file)
        if not isinstance(plan, Plan) or plan.fingerprint != obj.plan_fingerprint:
            fail(f"--plan {plan_file} is not the plan this report ran; give that plan's file")
        print_comparison(obj, plan, console)


def compare(
    plan_files: Annotated[list[Path], typer.Argument(metavar="PLAN...", help="Plan JSON files.")],
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="table, csv, json or markdown.")
    ] = "table",
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="File to write (atomically).")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw step times, stage times and memory (.png, .svg, .pdf)."),
    ] = None,
    stages: Annotated[
        bool, typer.Option("--stages", help="Also print each plan's stages (--format table).")
    ] = False,
) -> None:
    """Compare plans side by side: step time, ratio to the best, bubble, memory, samples/s."""
    from pipeplan.planner.io import load_plan, write_text
    from pipeplan.report.compare import FORMATS, compare_frame, render, unlike_work
    from pipeplan.report.terminal import compare_table, console, err_console, stage_table

    if fmt not in FORMATS:
        fail(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if stages and (fmt != "table" or output is not None):
        fail("--stages prints a table per plan on the terminal: leave out --format and -o")
    if output is not None:
        check_output(output)
    if plot is not None:
        check_output(plot)
        if plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            fail(f"--plot {plot} must end in .png, .svg or .pdf")
    plans = [load_plan(path) for path in plan_files]
    names = [path.stem for path in plan_files]
    unlike = unlike_work(plans)
    if unlike:
        err_console.print(f"warning: {unlike}", highlight=False)
    df = compare_frame(plans, names)
    if plot is not None:
        from pipeplan.planner.io import write_atomic
        from pipeplan.report.plots import compare_figure

        figure = compare_figure(plans, names)
        write_atomic(plot, lambda fh: figure.savefig(fh, dpi=120, format=plot.suffix[1:].lower()))
        err_console.print(f"figure -> {plot}")
    if output is not None:
        write_text(output, render(df, fmt))
        console.print(f"{len(plans)} plans -> {output}")
    elif fmt == "table":
        console.print(compare_table(df, width=console.width))
        if stages:
            for i in sorted(
                range(len(plans)), key=lambda i: (not plans[i].feasible, df["step_ms"][i])
            ):
                console.print(stage_table(plans[i], names[i]))
    else:
        sys.stdout.write(render(df, fmt))
