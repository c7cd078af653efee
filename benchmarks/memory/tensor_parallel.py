"""Predicted against measured peak memory per stage with tensor parallelism alone, with sequence
parallelism, and with loss parallelism too where the head splits over the vocabulary: pp 2 x
tp 2 on 4 CPU ranks, three models, GPipe and 1F1B.

For each model: profile once (the profile carries the tensor-parallel annotation, what each
unit's split and the sequence's split divide), then for each family and for ``--tensor-parallel
2`` alone, with ``--sequence-parallel`` and with ``--loss-parallel`` too, plan 2 stages
(unlimited memory, m = 4, nothing recomputed) and run them (``pipeplan run --warmup 2 --steps 1``).  The run report holds each
stage's first tp rank (the second holds the same shapes).  A CPU rank's measured peak is its
live tensors at the start of the tracked warm-up step plus the peak of that step's allocations
(``pipeplan.runtime.memory``); the prediction is the plan's ``memory.total`` from the per-rank
profile (:mod:`pipeplan.solvers.tensor_parallel`).

    PYTHONPATH=. .venv/bin/python -m benchmarks.memory.tensor_parallel   # results-tp.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import models_parser, pipeplan
from benchmarks.memory.main import SMALL, error_table, run_all, stage_rows, summary

HERE = Path(__file__).parent
#: name -> (model, kwargs, batch size, whether its head splits over the vocabulary): the zoo's
#: Llama with 4 heads and 2 KV heads (t = 2 splits both; its head is untied), its BERT, and the
#: bundled GPT (only its MLP splits; both tie their heads).
MODELS: dict[str, tuple[str, dict[str, Any], int, bool]] = {
    "zoo llama": ("pipeplan.models.zoo:llama", {**SMALL, "heads": 4, "kv_heads": 2}, 8, True),
    "zoo bert": ("pipeplan.models.zoo:bert", SMALL, 8, False),
    "gpt": ("pipeplan.models.gpt:gpt", {}, 16, False),
}
FAMILIES = ("gpipe", "1f1b")
#: mode -> the plan's options beside --tensor-parallel 2.
MODES = {"tp": (), "sp": ("--sequence-parallel",),
         "sp+lp": ("--sequence-parallel", "--loss-parallel")}  # fmt: skip


def run_case(name: str, work: Path) -> list[dict[str, Any]]:
    from pipeplan.planner.io import load_plan

    model, kwargs, batch, vocab_split = MODELS[name]
    profile = work / f"{name.replace(' ', '_')}.profile.json"
    margs = [a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")]
    pipeplan("profile", model, *margs, "--batch-size", str(batch), "--max-stages", "2",
             "--warmup", "0", "--repeats", "1", "-o", str(profile))  # fmt: skip
    rows = []
    for family in FAMILIES:
        for mode, options in MODES.items():
            if "--loss-parallel" in options and not vocab_split:
                continue
            plan, report = work / "plan.json", work / "report.json"
            pipeplan("plan", str(profile), "--stages", "2", "--tensor-parallel", "2", *options,
                     "--memory", "64GiB", "--microbatches", "4", "--checkpoint", "never",
                     "--schedule", family, "-o", str(plan))  # fmt: skip
            pipeplan("run", str(plan), "--warmup", "2", "--steps", "1", "--quiet",
                     "--report", str(report))  # fmt: skip
            p = load_plan(plan)
            assert p.cluster.tensor_parallel == 2 and p.cluster.sequence_parallel == (mode != "tp")
            rows += stage_rows(plan, report, model=name, family=family, mode=mode)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines, by_mode = error_table(rows, ("model", "family", "mode", "stage"), "mode")
    lines.append("")
    lines += [f"- {mode}: {summary(errs)}" for mode, errs in by_mode.items()]
    errors = [e for v in by_mode.values() for e in v]
    lines.append(f"- all: {summary(errors)} ({len(errors)} stages)")
    lines += ["", "| model | family | mode | stage | saved against tp alone, predicted | measured |",
              "|---|---|---|---:|---:|---:|"]  # fmt: skip
    by_key = {(r["model"], r["family"], r["stage"], r["mode"]): r for r in rows}
    for (model, family, stage, mode), r in by_key.items():
        base = by_key.get((model, family, stage, "tp"))
        if mode != "tp" and base is not None:
            lines.append(
                f"| {model} | {family} | {mode} | {stage} | "
                f"{1 - r['predicted'] / base['predicted']:+.1%} | "
                f"{1 - r['measured'] / base['measured']:+.1%} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = models_parser(__doc__ or "", MODELS, HERE)
    ap.set_defaults(output=str(HERE / "results-tp.json"))
    args = ap.parse_args()
    run_all(args.models, run_case, table, args.output)


if __name__ == "__main__":
    main()
