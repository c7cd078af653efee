"""Two devices, two ways: a 2-stage pipeline (p = 2, d = 1) against two data-parallel replicas
of the whole model (p = 1, d = 2), measured on 2 CPU ranks beside the planner's prediction.

For each model: profile once with 1 thread per rank, then take the best plan of each depth
from :func:`pipeplan.solvers.devices.plan_devices` (what ``pipeplan plan --devices 2`` prints), and run
the two plans alternately, ``--rounds`` times each (``pipeplan run --warmup 2 --steps 5``).
Each round gives the ratio of the two measured step times (p = 2 over p = 1, both the global
batch); the table gives the median ratio and its spread over rounds beside the predicted
ratio.

    pipeplan calibrate --nproc 2 --launches 1 -o cluster.json     # the links and the engine
    PYTHONPATH=. .venv/bin/python -m benchmarks.devices.main --cluster cluster.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine, models_parser, pipeplan

HERE = Path(__file__).parent

#: name -> (model, model arguments, global batch).
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt": ("pipeplan.models.gpt:gpt", {"n_layers": 4}, 16),
    "zoo llama": ("pipeplan.models.zoo:llama", {"n_layers": 4, "d_model": 128, "seq_len": 64}, 16),
}


def run_case(name: str, work: Path, rounds: int, cluster: Path | None) -> dict[str, Any]:
    from pipeplan.planner.io import load_cluster, load_profile, load_report, write_json
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.solvers.devices import plan_devices
    from pipeplan.solvers.dp import solve_dp

    options = PlanOptions(checkpoint="except_last")  # the policy the README's figures ran
    model, kwargs, batch = MODELS[name]
    profile = work / "profile.json"
    margs = [a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")]
    pipeplan("profile", model, *margs, "--batch-size", str(batch), "--threads", "1",
         "-o", str(profile))  # fmt: skip
    prof = load_profile(profile)
    clus = load_cluster(cluster) if cluster else Cluster.homogeneous(1, 64 << 30)
    one = clus.model_copy(update={"devices": clus.devices[:1]})
    choices = {c.stages: c for c in plan_devices(prof, 2, one, options, solve_dp)}
    plans = {}
    for p in (1, 2):
        plan = choices[p].plan
        assert plan is not None, choices[p].reason
        plans[p] = work / f"plan{p}.json"
        write_json(plans[p], plan)
    predicted = choices[2].plan.step_time_s / choices[1].plan.step_time_s  # type: ignore[union-attr]
    measured: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(rounds):
        for p in (2, 1):
            report = work / f"report{p}.json"
            pipeplan("run", str(plans[p]), "--warmup", "2", "--steps", "5", "--threads", "1",
                 "--report", str(report))  # fmt: skip
            measured[p].append(load_report(report).step_time_s)
    ratios = [a / b for a, b in zip(measured[2], measured[1], strict=True)]
    return {
        "model": name,
        "m": {p: choices[p].plan.microbatches for p in (1, 2)},  # type: ignore[union-attr]
        "predicted_s": {p: choices[p].plan.step_time_s for p in (1, 2)},  # type: ignore[union-attr]
        "measured_s": measured,
        "ratios": ratios,
        "predicted_ratio": predicted,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| model | m (p=2 / p=1) | p=2,d=1 step | p=1,d=2 step "
            "| measured ratio, median (range) | predicted ratio |"
        ),
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        med = {p: statistics.median(r["measured_s"][p]) * 1e3 for p in (1, 2)}
        ratio = statistics.median(r["ratios"])
        lines.append(
            f"| {r['model']} | {r['m'][2]} / {r['m'][1]} | {med[2]:.1f} ms | {med[1]:.1f} ms "
            f"| {ratio:.2f} ({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) "
            f"| {r['predicted_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = models_parser(__doc__ or "", MODELS, HERE)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cluster", type=Path, help="plan with this cluster file (calibrate's)")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(run_case(name, Path(tmp), args.rounds, args.cluster))
        print(json.dumps(rows[-1]), flush=True)
    out = {"machine": machine(), "cluster": str(args.cluster), "rows": rows}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
