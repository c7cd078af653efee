"""Predicted against measured peak memory per stage: bundled and zoo models, 2 CPU ranks, every
checkpoint policy, GPipe and 1F1B.

For each model: profile once (``pipeplan profile``), then for each policy and schedule plan 2
stages with unlimited memory (``pipeplan plan --stages 2 --memory 64GiB``) and run it
(``pipeplan run --warmup 2 --steps 1``).  A CPU rank's measured peak is the bytes of its live
tensors at the start of the tracked warm-up step plus the peak of that step's allocations
(``pipeplan.runtime.memory``).  Prints one JSON line per run and the Markdown table, and writes
``results.json``.

    PYTHONPATH=. .venv/bin/python -m benchmarks.memory.main     # about 30 minutes on 2 cores
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine, models_parser, pipeplan

HERE = Path(__file__).parent
SMALL = {"n_layers": 4, "d_model": 128, "vocab": 4096, "seq_len": 64}

#: name -> (model, kwargs, batch size).
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt": ("pipeplan.models.gpt:gpt", {}, 16),
    "mlp": ("pipeplan.models.mlp:mlp", {}, 64),
    "resnet": ("pipeplan.models.resnet:resnet", {}, 16),
    "zoo llama": ("pipeplan.models.zoo:llama", SMALL, 8),
    "zoo gpt2": ("pipeplan.models.zoo:gpt2", SMALL, 8),
    "zoo bert": ("pipeplan.models.zoo:bert", SMALL, 8),
}
POLICIES = ("never", "except_last", "always")
SCHEDULES = ("gpipe", "1f1b")


def run_case(name: str, work: Path) -> list[dict[str, Any]]:
    from pipeplan.planner.io import load_plan, load_report

    model, kwargs, batch = MODELS[name]
    profile = work / f"{name.replace(' ', '_')}.profile.json"
    margs = [a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")]
    pipeplan("profile", model, *margs, "--batch-size", str(batch), "--max-stages", "2",
         "--warmup", "0", "--repeats", "1", "-o", str(profile))  # fmt: skip
    rows = []
    for schedule in SCHEDULES:
        for policy in POLICIES:
            plan, report = work / "plan.json", work / "report.json"
            pipeplan("plan", str(profile), "--stages", "2", "--memory", "64GiB", "--microbatches",
                 "4", "--checkpoint", policy, "--schedule", schedule, "-o", str(plan))  # fmt: skip
            pipeplan("run", str(plan), "--warmup", "2", "--steps", "1", "--report", str(report))
            p, r = load_plan(plan), load_report(report)
            for stage, measured in zip(p.stages, r.stages):
                row = {
                    "model": name,
                    "schedule": schedule,
                    "policy": policy,
                    "stage": stage.index,
                    "m": p.microbatches,
                    "predicted": stage.memory.total,
                    "measured": measured.peak_memory_bytes,
                    "resident": measured.resident_growth_bytes,
                    "breakdown": stage.memory.model_dump(),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    from pipeplan.planner.io import format_bytes

    lines = [
        "| model | schedule | policy | stage | predicted | measured | error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    errors = []
    for r in rows:
        err = r["measured"] / r["predicted"] - 1
        errors.append(abs(err))
        lines.append(
            f"| {r['model']} | {r['schedule']} | {r['policy']} | {r['stage']} | "
            f"{format_bytes(r['predicted'])} | {format_bytes(r['measured'])} | {err:+.1%} |"
        )
    lines.append("")
    lines.append(
        f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
        f"({len(errors)} stages)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = models_parser(__doc__ or "", MODELS, HERE)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows += run_case(name, Path(tmp))
    Path(args.output).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
