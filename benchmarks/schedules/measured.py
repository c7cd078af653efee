"""Measured on 2 ranks: interleaved 1F1B and ZB-V against 1F1B, paired interleaved rounds.

    PYTHONPATH=. .venv/bin/python -m benchmarks.schedules.measured [--rounds 3 --steps 3]

The bundled GPT's profile (``out/gpt.profile.json``, batch 32) is planned for p = 2 under each
family (``solve_schedule``, 256 MiB per device), and each plan runs under ``pipeplan run``'s
runner (:mod:`pipeplan.runtime.worker`: torch's own schedule class on gloo, 1 thread per
rank).  Every round runs the three families one after the other, in a rotated order; each
run's median step over ``--steps`` (after one warm-up) is divided by the same round's 1F1B
step.  The table gives the median of the rounds' ratios, their range, and the predicted ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine
from pipeplan.planner.io import load_profile, write_json
from pipeplan.planner.types import Cluster, PlanOptions
from pipeplan.solvers.schedules import solve_schedule

HERE = Path(__file__).parent
FAMILIES = ("1f1b", "interleaved1f1b", "zbv")


def step_ms(plan_file: Path, steps: int) -> float:
    """The run report's median step (ms) of ``steps`` steps after one warm-up."""
    report = plan_file.with_suffix(".report.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "pipeplan.runtime.worker", str(plan_file), f"--steps={steps}", "--warmup=1",
           "--threads=1", "--quiet", f"--report={report}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return float(json.loads(report.read_text())["step_time_s"]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("-o", "--output", default=str(HERE / "measured.json"))
    args = ap.parse_args()
    profile = load_profile(HERE / "out/gpt.profile.json")
    cluster = Cluster.homogeneous(2, 256 * 2**20)
    plans, files = {}, {}
    for fam in FAMILIES:
        plans[fam] = solve_schedule(profile, cluster, PlanOptions(schedule=fam))  # type: ignore[arg-type]
        files[fam] = HERE / "out" / f"measured-{fam}.plan.json"
        write_json(files[fam], plans[fam].model_copy(update={"solve_time_s": None}))
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = FAMILIES[r % 3 :] + FAMILIES[: r % 3]
        got = {fam: step_ms(files[fam], args.steps) for fam in order}
        rounds.append(got)
        print(json.dumps({"round": r, **got}), flush=True)
    rows = []
    for fam in FAMILIES[1:]:
        ratios = [x[fam] / x["1f1b"] for x in rounds]
        rows.append({
            "family": fam, "v": plans[fam].stages_per_rank, "m": plans[fam].microbatches,
            "measured_ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "predicted_ratio": plans[fam].step_time_s / plans["1f1b"].step_time_s,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    Path(args.output).write_text(
        json.dumps({"machine": machine(), "rounds": rounds, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
