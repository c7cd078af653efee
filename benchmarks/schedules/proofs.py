"""The schedule benchmark's plans proven with the exact model (GPipe and 1F1B by default).

    PYTHONPATH=. .venv/bin/python -m benchmarks.schedules.proofs [--prove 5] [--families F,G]
        [--profiles P,Q] [-o proofs.json]

For each profile of :mod:`benchmarks.schedules.main` and p in 4, 8, 16, each family (GPipe and
1F1B unless ``--families`` names others) is planned twice by ``solve_schedule`` (family fixed; cuts, m and recomputation chosen under the
memory limit): with the default local search alone, whose gap is against ``family_bound``,
and with ``--prove T`` (``exact_time``: T deterministic seconds of CP-SAT per candidate m on
the exact model over torch's action order, :mod:`pipeplan.solvers.exact_order`), whose gap is
against the best bound CP-SAT proves.  Every figure but the CPU seconds is deterministic.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine
from benchmarks.schedules.main import LINK, profiles
from pipeplan.planner.errors import PipeplanError
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.solvers.multichunk import solve_schedule

HERE = Path(__file__).parent
FAMILIES = ("gpipe", "1f1b")


def run(
    prove: float, families: tuple[str, ...] = FAMILIES, names: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    rows = []
    for name, (prof, memory, _) in profiles().items():
        if names is not None and name not in names:
            continue
        for p in (4, 8, 16):
            if p > prof.n_units:
                continue
            cluster = Cluster.homogeneous(p, memory, LINK)
            for fam in families:
                options = PlanOptions(schedule=fam)  # type: ignore[arg-type]
                t0 = time.process_time()
                try:
                    searched = solve_schedule(prof, cluster, options)
                except PipeplanError as exc:  # too few units for p v chunks, or no fit
                    print(f"{name} p={p} {fam}: {exc}", flush=True)
                    continue
                t1 = time.process_time()
                proven = solve_schedule(prof, cluster, options, exact_time=prove)
                t2 = time.process_time()
                row = {
                    "profile": name, "p": p, "family": fam, "m": proven.microbatches,
                    "search_step_s": searched.step_time_s, "search_status": searched.status,
                    "search_gap": searched.gap, "search_cpu_s": t1 - t0,
                    "prove_step_s": proven.step_time_s, "prove_status": proven.status,
                    "prove_gap": proven.gap, "prove_cpu_s": t2 - t1,
                }  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def _status(status: str, gap: float | None) -> str:
    return status if gap is None else f"{status} ({100 * gap:.1f} %)"


def table(rows: list[dict[str, Any]]) -> str:
    head = "| profile | p | family | m | search: step ms, status (gap) | --prove: step ms, "
    lines = [head + "status (gap) | --prove CPU s |", "|---|---:|---|---:|---|---|---:|"]
    for r in rows:
        lines.append(
            f"| {r['profile']} | {r['p']} | {r['family']} | {r['m']} | "
            f"{1e3 * r['search_step_s']:.3f}, {_status(r['search_status'], r['search_gap'])} | "
            f"{1e3 * r['prove_step_s']:.3f}, {_status(r['prove_status'], r['prove_gap'])} | "
            f"{r['prove_cpu_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prove", type=float, default=5.0, help="deterministic s per candidate")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    ap.add_argument("--profiles", default=None, help="comma-separated (default: every one)")
    ap.add_argument("-o", "--output", default=str(HERE / "proofs.json"))
    args = ap.parse_args()
    names = None if args.profiles is None else tuple(args.profiles.split(","))
    rows = run(args.prove, tuple(args.families.split(",")), names)
    out = {"machine": machine(), "prove": args.prove, "rows": rows}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
