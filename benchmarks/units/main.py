"""Units that adapt: how many units ``auto`` makes, and how well the DP then balances stages.

    PYTHONPATH=. .venv/bin/python -m benchmarks.units.main [--only NAME ...]

For every model (the bundled ones, the zoo at its default tiny size, and a plain
``nn.Sequential`` body behind a wrapper with one dominant layer): profile with the default
options (one warm-up, 5 repeats, median of 3 rounds, 1 thread, batch 8), then plan p = 2, 4
and 8 stages with the DP (1 GiB per device, m = p, SGD, no recomputation, free links) and
report the plan's slowest stage divided by the mean stage, max_j t_j / (sum_j t_j / p): 1.00 is
a perfect balance.  No recomputation, because with ``except_last`` every stage but the last
pays its units' recomputation, and on these tiny models a unit's checkpointed backward costs up
to twice its plain forward and backward: the DP then rightly loads the last stage, which says
nothing about the units.  A p the profile has fewer
units for is reported as refused.  Prints the README's table and writes ``results.json``.

The script runs unchanged on an older checkout (it passes ``max_stages`` only where
``profile_model`` takes it), which is how the README's "before" columns were measured.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "zoo"))  # _user_models

#: (name, model, kwargs); the zoo's models at their defaults.
MODELS: list[tuple[str, str, dict[str, Any]]] = [
    ("sequential (wrapper, 25 layers)", "_user_models:sequential", {}),
    ("gpt", "pipeplan.models.gpt:gpt", {}),
    ("resnet", "pipeplan.models.resnet:resnet", {}),
    ("mlp", "pipeplan.models.mlp:mlp", {}),
    ("hf gpt2", "pipeplan.models.hf:gpt2", {}),
    ("hf llama", "pipeplan.models.hf:llama", {}),
    *[
        (f"zoo {n}", f"pipeplan.models.zoo:{n}", {})
        for n in ("llama", "bert", "t5", "vit", "mixtral")
    ],
]
STAGES = (2, 4, 8)


def measure(model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Units under ``auto`` and the DP plans' balance for ``STAGES``."""
    from pipeplan.planner.errors import PipeplanError
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.profiler import profile_model
    from pipeplan.solvers import SOLVERS

    options: dict[str, Any] = {
        "warmup": 1,
        "repeats": 5,
        "rounds": 3,
        "progress": False,
        "threads": 1,
    }
    if "max_stages" in inspect.signature(profile_model).parameters:
        options["max_stages"] = max(STAGES)
    profile = profile_model(model, batch_size=8, model_kwargs=kwargs, **options)
    balance: dict[int, float | None] = {}
    for p in STAGES:
        try:
            plan = SOLVERS["dp"](
                profile,
                Cluster.homogeneous(p, 1 << 30),
                PlanOptions(microbatches=p, optimizer="sgd", checkpoint="never"),
            )
        except PipeplanError:
            balance[p] = None
            continue
        times = [s.time_s for s in plan.stages]
        balance[p] = max(times) / (sum(times) / p)
    return {"units": profile.n_units, "balance": balance}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="model names (default: all)")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--before", help="results.json of an older checkout: print both, side by side")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {}
    for name, model, kwargs in MODELS:
        if args.only and name not in args.only and model not in args.only:
            continue
        try:
            results[name] = measure(model, kwargs)
        except Exception as exc:  # noqa: BLE001 - an old checkout may fail a model: record it
            results[name] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}
        print(name, results[name], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    before = json.loads(Path(args.before).read_text()) if args.before else {}
    print(table(results, before))


def _cell(result: dict[str, Any] | None, p: int) -> str:
    if not result or "error" in result:
        return "error"
    value = result["balance"].get(str(p), result["balance"].get(p))
    return "refused" if value is None else f"{value:.2f}"


def table(after: dict[str, Any], before: dict[str, Any]) -> str:
    """The README's Markdown table: units and balance, before -> after."""
    head = "| model | units | " + " | ".join(f"p = {p}" for p in STAGES) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(STAGES)]
    for name, res in after.items():
        old = before.get(name)
        units = str(res.get("units", "error"))
        if old is not None:
            units = f"{old.get('units', 'error')} → {units}"
        cells = [(f"{_cell(old, p)} → " if old is not None else "") + _cell(res, p) for p in STAGES]
        lines.append(f"| {name} | {units} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
