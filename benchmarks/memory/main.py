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
from collections.abc import Callable, Sequence
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


def profile_model(name: str, work: Path, max_stages: int) -> Path:
    """``pipeplan profile`` of ``MODELS[name]`` cut for up to ``max_stages`` stages (one timed
    pass: only its bytes matter here) into ``work``; the profile's path."""
    model, kwargs, batch = MODELS[name]
    profile = work / f"{name.replace(' ', '_')}.profile.json"
    margs = [a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")]
    pipeplan("profile", model, *margs, "--batch-size", str(batch), "--max-stages",
             str(max_stages), "--warmup", "0", "--repeats", "1", "-o", str(profile))  # fmt: skip
    return profile


def run_case(name: str, work: Path) -> list[dict[str, Any]]:

    profile = profile_model(name, work, 2)
    rows = []
    for schedule in SCHEDULES:
        for policy in POLICIES:
            plan, report = work / "plan.json", work / "report.json"
            pipeplan("plan", str(profile), "--stages", "2", "--memory", "64GiB", "--microbatches",
                 "4", "--checkpoint", policy, "--schedule", schedule, "-o", str(plan))  # fmt: skip
            pipeplan("run", str(plan), "--warmup", "2", "--steps", "1", "--report", str(report))
            rows += stage_rows(plan, report, model=name, schedule=schedule, policy=policy)
    return rows


def stage_rows(plan: Path, report: Path, **labels: Any) -> list[dict[str, Any]]:
    """One row per stage of the plan file and the run report file: ``labels``, the stage,
    m, predicted and measured peak, resident growth and the predicted breakdown; each
    printed as a JSON line."""
    from pipeplan.planner.io import load_plan, load_report

    p, r = load_plan(plan), load_report(report)
    rows = []
    for stage, measured in zip(p.stages, r.stages, strict=True):
        row = {
            **labels,
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


def error_table(
    rows: list[dict[str, Any]], columns: Sequence[str], group: str
) -> tuple[list[str], dict[str, list[float]]]:
    """Markdown lines, one per row: its ``columns``, predicted, measured and the relative
    error; and the |errors| by the rows' ``group`` value."""
    from pipeplan.planner.io import format_bytes

    lines = [
        f"| {' | '.join(columns)} | predicted | measured | error |",
        "|" + "---|" * len(columns) + "---:|---:|---:|",
    ]
    errors: dict[str, list[float]] = {}
    for r in rows:
        err = r["measured"] / r["predicted"] - 1
        errors.setdefault(r[group], []).append(abs(err))
        cells = [
            ", ".join(map(str, r[c])) if isinstance(r[c], list) else str(r[c]) for c in columns
        ]
        lines.append(
            f"| {' | '.join(cells)} | {format_bytes(r['predicted'])} | "
            f"{format_bytes(r['measured'])} | {err:+.1%} |"
        )
    return lines, errors


def table(rows: list[dict[str, Any]]) -> str:
    lines, by_model = error_table(rows, ("model", "schedule", "policy", "stage"), "model")
    errors = [e for v in by_model.values() for e in v]
    return "\n".join([*lines, "", f"{summary(errors)} ({len(errors)} stages)"])


def summary(errors: Sequence[float]) -> str:
    """``median |error| M, worst W`` of relative errors."""
    return f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def run_all(
    models: Sequence[str],
    case: Callable[[str, Path], list[dict[str, Any]]],
    show: Callable[[list[dict[str, Any]]], str],
    output: str,
) -> None:
    """Run ``case`` for every model in one temporary folder, write the rows and the machine to
    ``output`` and print their table."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            rows += case(name, Path(tmp))
    Path(output).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    print(show(rows))


def main() -> None:
    args = models_parser(__doc__ or "", MODELS, HERE).parse_args()
    run_all(args.models, run_case, table, args.output)


if __name__ == "__main__":
    main()
