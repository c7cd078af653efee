"""Measured on 2 ranks: interleaved 1F1B, ZB-V and DualPipeV against 1F1B, paired rounds.

    PYTHONPATH=. .venv/bin/python -m benchmarks.schedules.measured --prepare [--rounds 5]

``--prepare`` first profiles the bundled GPT (batch 32, ``out/gpt-quiet.profile.json``) and
calibrates this machine for 2 ranks (``out/cluster-cpu.json``: links, engine costs, compute
contention k); without it the two files are read as they are.  Each family's plan for p = 2
under 256 MiB a device is the schedule solver's (``solve_schedule``) on that calibrated
cluster, and runs under ``pipeplan run`` (torch's own schedule class on gloo, 1 thread per
rank; the step is the run report's median over ``--steps`` after one warm-up).  Every round
runs the families one after the other in a rotated order; each run is divided by the same
round's 1F1B step.  The table gives the median of the rounds' ratios, their range, the
predicted ratio, and the predicted ratio the same plans get without contention (k = 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import machine, pipeplan
from pipeplan.planner.io import load_cluster, load_profile, write_json
from pipeplan.planner.replay import replay_plan
from pipeplan.planner.types import Plan, PlanOptions
from pipeplan.solvers.multichunk import solve_schedule

HERE = Path(__file__).parent
FAMILIES = ("1f1b", "interleaved1f1b", "zbv", "dualpipev")
MEMORY = 256 * 2**20


def step_ms(plan_file: Path, steps: int) -> float:
    """The median measured step (ms) of ``pipeplan run`` on the plan: its run report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pipeplan("run", str(plan_file), f"--steps={steps}", "--warmup=1", "--threads=1",
                 "--quiet", "--report", str(report))  # fmt: skip
        return float(json.loads(report.read_text())["step_time_s"]) * 1e3


def without_contention(plan: Plan) -> float:
    """The plan's simulated step with the compute contention k set to 0."""
    calm = plan.cluster.model_copy(update={"contention": 0.0})
    return replay_plan(plan.model_copy(update={"cluster": calm}), timeline=False).makespan_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", action="store_true", help="profile and calibrate first")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("-o", "--output", default=str(HERE / "measured.json"))
    args = ap.parse_args()
    out = HERE / "out"
    prof_file, cluster_file = out / "gpt-quiet.profile.json", out / "cluster-cpu.json"
    if args.prepare:
        pipeplan("profile", "pipeplan.models.gpt:gpt", "--batch-size=32", "--quiet",
                 "-o", str(prof_file))  # fmt: skip
        pipeplan("calibrate", "--nproc=2", "--quiet", "-o", str(cluster_file))
    profile = load_profile(prof_file)
    calibrated = load_cluster(cluster_file)
    cluster = calibrated.model_copy(
        update={
            "devices": tuple(
                d.model_copy(update={"memory_bytes": MEMORY}) for d in calibrated.devices
            )
        }
    )
    plans, files = {}, {}
    for fam in FAMILIES:
        plans[fam] = solve_schedule(profile, cluster, PlanOptions(schedule=fam))  # type: ignore[arg-type]
        files[fam] = out / f"measured-{fam}.plan.json"
        write_json(files[fam], plans[fam].model_copy(update={"solve_time_s": None}))
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        k = r % len(FAMILIES)
        order = FAMILIES[k:] + FAMILIES[:k]
        got = {fam: step_ms(files[fam], args.steps) for fam in order}
        rounds.append(got)
        print(json.dumps({"round": r, **got}), flush=True)
    base = plans["1f1b"]
    rows = []
    for fam in FAMILIES:
        ratios = [x[fam] / x["1f1b"] for x in rounds]
        plan = plans[fam]
        rows.append({
            "family": fam, "v": plan.stages_per_rank, "m": plan.microbatches,
            "measured_ms": statistics.median(x[fam] for x in rounds),
            "predicted_ms": plan.step_time_s * 1e3,
            "measured_ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "predicted_ratio": plan.step_time_s / base.step_time_s,
            "predicted_ratio_k0": without_contention(plan) / without_contention(base),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    summary = {
        "machine": machine(),
        "contention": cluster.contention,
        "rounds": rounds,
        "rows": rows,
    }
    Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
