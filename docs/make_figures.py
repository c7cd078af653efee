"""Draws the README's tour figures from the demo's files, with pipeplan's own plotting code.

    make demo                                  # writes out/gpt.profile.json and out/gpt.plan.json
    .venv/bin/python docs/make_figures.py      # writes out/img/tour-compare.png, tour-gantt.png
    .venv/bin/python docs/make_figures.py --update-docs   # replaces the tracked docs/img/ ones

The demo's plan (`--schedule auto`) is compared with the `uniform` and `params` baselines at
m = 4 on the same devices, as the README's tour plans them (each the faster of its GPipe and
1F1B plans) (``pipeplan.report.plots.compare_figure``, what
``pipeplan compare --plot`` draws), and its simulated step is drawn as a Gantt chart
(``pipeplan.report.timeline_plots.gantt``).  The profile is a measurement of this machine, so
the figures change a little from one run to the next.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeplan.planner.io import load_plan, load_profile
from pipeplan.planner.types import PlanOptions
from pipeplan.report.plots import compare_figure
from pipeplan.report.timeline_plots import gantt
from pipeplan.solvers.choose import solve


DOCS_IMG = Path(__file__).parent / "img"


def main(out: Path = Path("out"), img: Path = Path("out") / "img") -> None:
    profile = load_profile(out / "gpt.profile.json")
    plan = load_plan(out / "gpt.plan.json")
    options = PlanOptions(
        microbatches=4,  # the tour's `pipeplan plan ... --microbatches 4 --solver S`
        checkpoint=plan.checkpoint,
        schedule="auto",
        optimizer=plan.optimizer,
    )
    baselines = [solve(profile, plan.cluster, options, name) for name in ("uniform", "params")]
    img.mkdir(parents=True, exist_ok=True)
    figures = {
        "tour-compare.png": compare_figure(
            [plan, *baselines], ["gpt.plan", "gpt.uniform", "gpt.params"]
        ),
        "tour-gantt.png": gantt(plan),
    }
    for name, fig in figures.items():
        fig.savefig(img / name, dpi=80, bbox_inches="tight")
        print(f"-> {img / name}", file=sys.stderr)


if __name__ == "__main__":
    main(img=DOCS_IMG if "--update-docs" in sys.argv[1:] else Path("out") / "img")
