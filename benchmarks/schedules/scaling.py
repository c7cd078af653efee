"""How the exact model's gap falls with its budget, on the schedule benchmark's hardest rows.

    PYTHONPATH=. .venv/bin/python -m benchmarks.schedules.scaling [--budgets 5,60,300]
        [--rows NAME:P:FAMILY:V:M,...] [-o scaling.json]
    PYTHONPATH=. .venv/bin/python -m benchmarks.schedules.scaling --families NAME:P:FAMILY,...
        [--prove 300]

Each row is one candidate (family, v, m) of :mod:`benchmarks.schedules.main` (its plan's), so
that the budget is not shared among candidates: ``solve_schedule`` with ``chunks=v`` and
``microbatches=m``, once with the local search alone and once per budget T (``exact_time``: T
deterministic seconds of CP-SAT on the exact model over torch's action order, and T more for
the final gap's chain model).  Every figure but the CPU seconds is deterministic.

With ``--families``, whole rows instead (:func:`run_families`: every candidate of the family,
as a user's ``--schedule FAMILY --prove T`` plans it), appended to ``scaling.json``'s
``families`` with the commit they ran at.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine
from benchmarks.schedules.main import LINK, profiles
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.solvers.multichunk import solve_schedule

HERE = Path(__file__).parent
ROWS = (
    "zoo-llama:4:interleaved1f1b:2:4",
    "zoo-llama:8:interleaved1f1b:2:16",
    "zoo-bert:4:loopedbfs:2:8",
    "zoo-t5:8:zbv:2:4",
    "llama7b:8:loopedbfs:3:16",
    "synth:4:zb-interleaved:2:8",
)


def run(rows: list[str], budgets: list[float]) -> list[dict[str, Any]]:
    table = profiles()
    out = []
    for spec in rows:
        name, p, family, v, m = spec.split(":")
        prof, memory, _ = table[name]
        cluster = Cluster.homogeneous(int(p), memory, LINK)
        options = PlanOptions(schedule=family, microbatches=int(m))  # type: ignore[arg-type]
        for budget in [0.0, *budgets]:
            t0 = time.process_time()
            plan = solve_schedule(prof, cluster, options, chunks=int(v), exact_time=budget)
            row = {
                "row": spec, "prove": budget, "step_s": plan.step_time_s, "status": plan.status,
                "gap": plan.gap, "cpu_s": time.process_time() - t0,
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def _commit() -> str:
    git = ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()


def run_families(rows: list[str], prove: float) -> list[dict[str, Any]]:
    """Whole rows, as a user asks them: ``solve_schedule`` with the family fixed, v and m free,
    and ``prove`` deterministic seconds of the exact model for every candidate."""
    table = profiles()
    out = []
    for spec in rows:
        name, p, family = spec.split(":")
        prof, memory, _ = table[name]
        cluster = Cluster.homogeneous(int(p), memory, LINK)
        options = PlanOptions(schedule=family, prove=prove)  # type: ignore[arg-type]
        t0 = time.process_time()
        plan = solve_schedule(prof, cluster, options)
        row = {
            "row": spec, "prove": prove, "v": plan.stages_per_rank, "m": plan.microbatches,
            "step_s": plan.step_time_s, "status": plan.status, "gap": plan.gap,
            "cpu_s": time.process_time() - t0, "commit": _commit(),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="5,60,300")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("-o", "--output", default=str(HERE / "scaling.json"))
    ap.add_argument("--families", help="whole rows NAME:P:FAMILY,... (then --prove T)")
    ap.add_argument("--prove", type=float, default=300.0)
    args = ap.parse_args()
    out = Path(args.output)
    data = json.loads(out.read_text()) if out.exists() else {}
    if args.families:  # appended: whole rows take hours, a run measures a few
        data.setdefault("families", []).extend(run_families(args.families.split(","), args.prove))
    else:
        data["rows"] = run(args.rows.split(","), [float(b) for b in args.budgets.split(",")])
    data["machine"] = machine()
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
