"""Recomputation chosen per stage (``--checkpoint auto``) against the best fixed policy.

Predicted: for each model, profile once (``pipeplan profile --threads 1``), then for p = 2 and
p = 4 stages and three memory limits, solve with the DP under ``auto`` and under each fixed
policy (``never``, ``except_last``, ``always``).  The limits come from the model itself:

    loose    K, the largest stage of the best ``never`` plan with unlimited memory (every stage
             can keep, so ``auto`` is ``never``)
    tight    F, the least memory with which any plan fits (``always``; by bisection, to 0.1 %)
    medium   (K + F) / 2

The table gives the predicted step time of ``auto`` over the best fixed policy that fits, each
stage's choice (K keeps, R recomputes), whether ``auto`` differs from every fixed policy (its
choices are a mix no fixed policy makes: neither all K, all R, nor R...RK), and cases that
only ``auto`` makes feasible.

Measured (``--measure K``): the K cases with p = 2 where ``auto`` is predicted faster than the
best fixed policy, of largest predicted gain and one per model: run both plans on 2 ranks
(``pipeplan run --warmup 2 --steps 5 --threads 1``), alternately, ``--rounds`` times; give each
plan's median step and the ratio's median and range over rounds.

    PYTHONPATH=. .venv/bin/python -m benchmarks.recompute.main --measure 2
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine, models_parser, pipeplan
from benchmarks.memory.main import MODELS as MEMORY_MODELS

HERE = Path(__file__).parent
MODELS = MEMORY_MODELS  # the memory benchmark's bundled and zoo models
FIXED = ("never", "except_last", "always")
STAGES = (2, 4)


def _solve(prof: Any, p: int, memory: float, policy: str) -> Any:
    from pipeplan.planner.errors import InfeasiblePlanError
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.solvers.dp import solve_dp

    options = PlanOptions.model_validate({"checkpoint": policy})
    try:
        return solve_dp(prof, Cluster.homogeneous(p, int(memory)), options)
    except InfeasiblePlanError:
        return None


def _peak(plan: Any) -> int:
    return max(s.memory.total for s in plan.stages)


def _mixed(choices: list[bool]) -> bool:
    """Whether per-stage choices are a mix that no fixed policy makes."""
    p = len(choices)
    return choices not in ([False] * p, [True] * p, [True] * (p - 1) + [False])


def _least_memory(prof: Any, p: int) -> float:
    """The least memory per device with which some plan of p stages fits (within 0.1 %, and
    fits)."""
    lo, hi = 0.0, float(_peak(_solve(prof, p, 2**50, "always")))
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _solve(prof, p, mid, "always") is not None else (mid, hi)
    return hi


def plan_cases(name: str, profile: Path, work: Path) -> list[dict[str, Any]]:
    """Every (p, limit) case of one model, with each policy's plan written under ``work``."""
    from pipeplan.planner.io import load_profile, write_json

    prof = load_profile(profile)
    rows = []
    for p in STAGES:
        if prof.n_units < p:
            continue
        K, F = _peak(_solve(prof, p, 2**50, "never")), _least_memory(prof, p)
        for limit, memory in (("loose", K), ("medium", (K + F) / 2), ("tight", F)):
            plans = {pol: _solve(prof, p, memory, pol) for pol in ("auto", *FIXED)}
            fitting = {pol: plans[pol].step_time_s for pol in FIXED if plans[pol] is not None}
            best = min(fitting, key=fitting.__getitem__) if fitting else None
            auto = plans["auto"]
            row: dict[str, Any] = {
                "model": name,
                "p": p,
                "limit": limit,
                "memory": int(memory),
                "steps": {pol: (pl.step_time_s if pl else None) for pol, pl in plans.items()},
                "best_fixed": best,
                "auto_choices": [s.recompute for s in auto.stages] if auto else None,
                "auto_m": auto.microbatches if auto else None,
                "auto_status": auto.status if auto else None,
                "only_auto": auto is not None and best is None,
                "differs": auto is not None and _mixed([s.recompute for s in auto.stages]),
            }
            if auto is not None and best is not None:
                row["ratio"] = auto.step_time_s / fitting[best]
                if row["ratio"] < 1 - 1e-9:  # a better plan than every fixed policy's
                    for pol in ("auto", best):
                        path = work / f"{name.replace(' ', '_')}-{p}-{limit}-{pol}.json"
                        write_json(path, plans[pol])
                        row.setdefault("plans", {})[pol] = str(path)
            print(json.dumps({k: v for k, v in row.items() if k != "plans"}), flush=True)
            rows.append(row)
    return rows


def _to_measure(rows: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The ``k`` cases with p = 2 where ``auto`` is predicted faster than the best fixed policy,
    of largest predicted gain, at most one per model."""
    chosen: dict[str, dict[str, Any]] = {}
    for row in sorted((r for r in rows if r["p"] == 2 and "plans" in r), key=lambda r: r["ratio"]):
        chosen.setdefault(row["model"], row)
    return sorted(chosen.values(), key=lambda r: r["ratio"])[:k]


def measure(row: dict[str, Any], rounds: int, work: Path) -> dict[str, Any]:
    """Run ``auto``'s plan and the best fixed policy's, alternately, ``rounds`` times each."""
    from pipeplan.planner.io import load_report

    pols = ("auto", row["best_fixed"])
    steps: dict[str, list[float]] = {pol: [] for pol in pols}
    for _ in range(rounds):
        for pol in pols:
            report = work / "report.json"
            pipeplan("run", row["plans"][pol], "--warmup", "2", "--steps", "5", "--threads", "1",
                     "--report", str(report))  # fmt: skip
            steps[pol].append(load_report(report).step_time_s)
    ratios = [a / b for a, b in zip(steps["auto"], steps[row["best_fixed"]], strict=True)]
    return {"measured_s": steps, "measured_ratios": ratios}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    from pipeplan.planner.io import format_bytes

    lines = [
        (
            "| model | p | limit | memory | never | except_last | always | auto (ms) "
            "| auto's stages | auto ÷ best fixed | differs |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        s = r["steps"]
        choice = "".join("R" if c else "K" for c in r["auto_choices"] or [])
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ("only auto" if r["only_auto"] else "-")
        lines.append(
            f"| {r['model']} | {r['p']} | {r['limit']} | {format_bytes(r['memory'])} "
            f"| {_fmt(s['never'])} | {_fmt(s['except_last'])} | {_fmt(s['always'])} "
            f"| {_fmt(s['auto'])} | {choice} | {ratio} | {'yes' if r['differs'] else ''} |"
        )
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    lines += [
        "",
        (
            f"{len(rows)} cases: auto ÷ best fixed {min(ratios):.3f}-{max(ratios):.3f}, median "
            f"{statistics.median(ratios):.3f}; {sum(r['differs'] for r in rows)} differ from every "
            f"fixed policy; {sum(r['only_auto'] for r in rows)} feasible only with auto."
        ),
    ]
    measured = [r for r in rows if "measured_ratios" in r]
    if measured:
        lines += [
            "",
            (
                "| model | p | limit | auto's stages / best fixed | auto step | fixed step "
                "| measured ratio, median (range) | predicted ratio |"
            ),
            "|---|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in measured:
            med = {k: statistics.median(v) for k, v in r["measured_s"].items()}
            q = r["measured_ratios"]
            choice = "".join("R" if c else "K" for c in r["auto_choices"])
            lines.append(
                f"| {r['model']} | {r['p']} | {r['limit']} | {choice} / {r['best_fixed']} "
                f"| {_fmt(med['auto'])} ms | {_fmt(med[r['best_fixed']])} ms "
                f"| {statistics.median(q):.3f} ({min(q):.3f}-{max(q):.3f}) | {r['ratio']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = models_parser(__doc__ or "", MODELS, HERE)
    ap.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="K",
        help="run the K p = 2 cases of largest predicted gain, one per model",
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models:
            model, kwargs, batch = MODELS[name]
            profile = work / f"{name.replace(' ', '_')}.profile.json"
            margs = [a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")]
            pipeplan("profile", model, *margs, "--batch-size", str(batch), "--threads", "1",
                     "--max-stages", str(max(STAGES)), "-o", str(profile))  # fmt: skip
            rows += plan_cases(name, profile, work)
        if args.measure:
            for row in _to_measure(rows, args.measure):
                row.update(measure(row, args.rounds, work))
                print(json.dumps({"model": row["model"], "limit": row["limit"],
                                  "ratios": row["measured_ratios"]}), flush=True)  # fmt: skip
    for row in rows:
        row.pop("plans", None)
    Path(args.output).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
