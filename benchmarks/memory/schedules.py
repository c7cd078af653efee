"""Predicted against measured peak memory per rank for the multi-chunk schedule families.

    PYTHONPATH=. .venv/bin/python -m benchmarks.memory.schedules [--models gpt "zoo llama"]

For each model: profile once (``pipeplan profile``, I and W measured), then for each family
(interleaved1f1b, loopedbfs, zb-interleaved, zbv, dualpipev) and checkpoint policy (never,
always) plan p = 2 ranks x v = 2 chunks with m = 4 and unlimited memory
(:func:`pipeplan.solvers.multichunk.solve_schedule`, 64 GiB per device) and run it
(``pipeplan run --warmup 2 --steps 1``).  A CPU rank's measured peak is what the run report
gives (``RunReport.ranks``): the bytes of its live tensors at the start of the tracked
warm-up step plus the peak of that step's allocations (``pipeplan.runtime.memory``).  The
prediction is ``Plan.rank_peak_bytes`` (the walk of torch's action list,
:mod:`pipeplan.solvers.chunks`).  Prints one JSON line per rank and the Markdown table, and
writes ``results-schedules.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import models_parser, pipeplan
from benchmarks.memory.main import MODELS as ALL_MODELS
from benchmarks.memory.main import error_table, profile_model, run_all, summary

HERE = Path(__file__).parent

#: name -> (model, kwargs, batch size): the bundled GPT and one zoo model.
MODELS = {k: ALL_MODELS[k] for k in ("gpt", "zoo llama")}
FAMILIES = ("interleaved1f1b", "loopedbfs", "zb-interleaved", "zbv", "dualpipev")
POLICIES = ("never", "always")


def run_case(name: str, work: Path) -> list[dict[str, Any]]:
    from pipeplan.planner.io import load_profile, load_report, write_json
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.solvers.multichunk import solve_schedule

    profile = load_profile(profile_model(name, work, 4))
    cluster = Cluster.homogeneous(2, 64 << 30)
    rows = []
    for family in FAMILIES:
        for policy in POLICIES:
            options = PlanOptions(schedule=family, checkpoint=policy, microbatches=4)  # type: ignore[arg-type]
            plan = solve_schedule(profile, cluster, options, chunks=2)
            plan_file, report_file = work / "plan.json", work / "report.json"
            write_json(plan_file, plan)
            pipeplan("run", str(plan_file), "--warmup", "2", "--steps", "1", "--quiet",
                     "--report", str(report_file))  # fmt: skip
            report = load_report(report_file)
            for r in report.ranks:
                row = {
                    "model": name,
                    "family": family,
                    "policy": policy,
                    "rank": r.rank,
                    "chunks": list(r.stages),
                    "cuts": [s.first_unit for s in plan.stages],
                    "m": plan.microbatches,
                    "predicted": plan.rank_peak_bytes[r.rank],
                    "measured": r.peak_memory_bytes,
                    "resident": r.resident_growth_bytes,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = ("model", "family", "policy", "rank", "chunks")
    lines, by_family = error_table(rows, columns, "family")
    lines.append("")
    lines += [f"- {fam}: {summary(errs)}" for fam, errs in by_family.items()]
    errors = [e for v in by_family.values() for e in v]
    lines.append(f"- all: {summary(errors)} ({len(errors)} ranks)")
    return "\n".join(lines)


def main() -> None:
    ap = models_parser(__doc__ or "", MODELS, HERE)
    ap.set_defaults(output=str(HERE / "results-schedules.json"))
    args = ap.parse_args()
    run_all(args.models, run_case, table, args.output)


if __name__ == "__main__":
    main()
