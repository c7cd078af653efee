"""Predicted against measured peak memory per rank with FSDP2 on the data-parallel axis: pp 2 x
dp 2 on 4 CPU ranks, three models, GPipe and 1F1B.

For each model: profile once, then for each family plan ``--devices 4 --dp 2 --data-parallel
shard`` (2 stages, each sharded over 2 ranks; unlimited memory, m = 4, a global batch of twice
the profile's) and run it (``pipeplan run --warmup 2 --steps 1``).  The run report holds the
first replica's ranks (the second's hold the same shapes).  A CPU rank's measured peak is its
live tensors at the start of the tracked warm-up step plus the peak of that step's
allocations (``pipeplan.runtime.memory``), FSDP2's all-gathered parameters and unsharded
gradients among them; the prediction is :mod:`pipeplan.planner.collectives`'.

    PYTHONPATH=. .venv/bin/python -m benchmarks.memory.mesh    # writes results-mesh.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import models_parser, pipeplan
from benchmarks.memory.main import MODELS as ALL_MODELS
from benchmarks.memory.main import error_table, profile_model, run_all, stage_rows, summary

HERE = Path(__file__).parent
MODELS = {k: ALL_MODELS[k] for k in ("gpt", "mlp", "zoo llama")}
FAMILIES = ("gpipe", "1f1b")


def run_case(name: str, work: Path) -> list[dict[str, Any]]:
    from pipeplan.planner.io import load_plan

    profile = profile_model(name, work, 2)
    batch = 2 * MODELS[name][2]
    rows = []
    for family in FAMILIES:
        plan, report = work / "plan.json", work / "report.json"
        pipeplan("plan", str(profile), "--devices", "4", "--dp", "2", "--data-parallel", "shard",
                 "--memory", "64GiB", "--microbatches", "4", "--schedule", family,
                 "--global-batch-size", str(batch), "--no-calibration", "-o", str(plan))  # fmt: skip
        pipeplan("run", str(plan), "--warmup", "2", "--steps", "1", "--report", str(report))
        p = load_plan(plan)
        assert p.cluster.data_parallel_mode == "shard" and p.cluster.data_parallel == 2
        rows += stage_rows(plan, report, model=name, family=family)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines, by_model = error_table(rows, ("model", "family", "stage"), "model")
    errors = [e for v in by_model.values() for e in v]
    return "\n".join([*lines, "", f"{summary(errors)} ({len(errors)} ranks)"])


def main() -> None:
    ap = models_parser(__doc__ or "", MODELS, HERE)
    ap.set_defaults(output=str(HERE / "results-mesh.json"))
    args = ap.parse_args()
    run_all(args.models, run_case, table, args.output)


if __name__ == "__main__":
    main()
