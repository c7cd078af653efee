"""Accuracy benchmark: the cost model's predicted step and stage times against real runs.

    .venv/bin/python -m benchmarks.accuracy.main [--quick] [--out out/accuracy]

For each model: profile it with one thread (as each of 2 ranks on 2 cores runs), calibrate the
link and the engine once, plan with the DP at every micro-batch count m in {1, 2, 4, 8} and
every checkpoint policy, for 1 and 2 stages, then run all plans of a (model, stages) pair
interleaved, one torchrun job per round (see ``job.py``).  The measured step time of a plan is the
median over rounds of each round's median step; per-stage forward and backward times are
medians over rounds, micro-batches and steps.

Two predictions are compared with it:

* ``predicted``: the plan's own simulated makespan, from the profile it was planned with (the
  closed form, the solvers' objective, is listed beside it);
* ``bracketed``: the same plan re-evaluated with the profiles taken just before and just after
  each round, averaged.  Every round is its own torchrun job, followed by a fresh profile, so a
  round's bracket is seconds old, not minutes.  This host's speed drifts by 10-50 % over
  minutes, more than the accuracy goal; bracketing separates the cost model's error from that
  drift.  ``bracketed_error`` is the median over rounds of each round's measured / bracketed,
  and ``drift`` the median over rounds of after / before - 1: how much the host moved within
  one round.

Writes ``results.csv`` and prints a markdown table with the summary the README quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd

from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.io import load_cluster, write_json
from pipeplan.planner.types import CheckpointPolicy, Cluster, Plan, PlanOptions, Profile
from pipeplan.profiler import profile_model
from pipeplan.report.compare import to_markdown
from pipeplan.runtime.calibrate import calibrate
from pipeplan.solvers.dp import solve_dp

ROOT = Path(__file__).resolve().parents[2]

#: name, model, kwargs, batch size
MODELS = [
    ("mlp", "pipeplan.models.mlp:mlp", {"width": 512, "depth": 8, "in_features": 512}, 128),
    ("resnet", "pipeplan.models.resnet:resnet", {"width": 16}, 32),
    ("gpt", "pipeplan.models.gpt:gpt", {"vocab": 4096, "n_layers": 4}, 16),
    ("hf-gpt2", "pipeplan.models.hf:gpt2", {}, 16),
]
MS = (1, 2, 4, 8)
POLICIES: dict[int, tuple[CheckpointPolicy, ...]] = {
    1: ("always", "never"),
    2: ("always", "except_last", "never"),
}


def run_job(plans: list[Path], nproc: int, out: Path, rounds: int, steps: int) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "benchmarks.accuracy.job",
        "--out", str(out), "--rounds", str(rounds), "--steps", str(steps), "--threads", "1",
        *map(str, plans),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, text=True)
    return json.loads(out.read_text())


def _profile(model: str, batch: int, kwargs: dict) -> Profile:
    return profile_model(model, batch_size=batch, model_kwargs=kwargs, threads=1,
                         warmup=2, repeats=3, rounds=3, progress=False)  # fmt: skip


def _simulated(plan: Plan, profile: Profile, cluster: Cluster) -> float:
    """The plan's partition and m, re-evaluated with another profile: its simulated makespan."""
    options = PlanOptions.model_validate(
        {"microbatches": plan.microbatches, "checkpoint": plan.checkpoint,
         "schedule": plan.schedule, "optimizer": plan.optimizer}
    )  # fmt: skip
    again = evaluate(profile, cluster, options, plan.boundaries, plan.microbatches, solver="dp")
    return again.simulated_step_time_s or again.step_time_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/accuracy")
    ap.add_argument("--quick", action="store_true", help="one model, fewer steps")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = MODELS[:1] if args.quick else MODELS

    cluster_file = out / "cluster.json"
    if not cluster_file.exists():
        cluster2, _ = calibrate(2, repeats=10)
        write_json(cluster_file, cluster2)
    cluster2 = load_cluster(cluster_file)
    print(
        f"cluster: {cluster2.link.latency_s * 1e6:.0f} us latency, "
        f"{(cluster2.link.bandwidth_Bps or 0) / 1e9:.2f} GB/s, "
        f"engine {cluster2.op_overhead_s * 1e6:.0f} us/op",
        flush=True,
    )

    rows, raw = [], []
    for name, model, kwargs, batch in models:
        prof = _profile(model, batch, kwargs)
        write_json(out / f"{name}.profile.json", prof)
        latest = prof
        for p in (1, 2):
            cluster = cluster2.model_copy(update={"devices": cluster2.devices[:p]})
            plans: list[Plan] = []
            plan_files = []
            for m in MS:
                if batch % m:
                    continue
                for policy in POLICIES[p]:
                    options = PlanOptions(microbatches=m, checkpoint=policy, optimizer="sgd")
                    plan = solve_dp(prof, cluster, options)
                    path = out / f"{name}.p{p}.m{m}.{policy}.plan.json"
                    write_json(path, plan)
                    plans.append(plan)
                    plan_files.append(path)
            # rounds[r][i]: plan i's RunReports of round r; sims[r][i]: its simulated makespan
            # with the profile taken just before round r (sims[r + 1] just after it)
            rounds: list[list[list[dict]]] = []
            sims = [[_simulated(plan, latest, cluster) for plan in plans]]
            for r in range(args.rounds):
                result = run_job(
                    plan_files, p, out / f"{name}.p{p}.r{r}.results.json", 1, args.steps
                )
                rounds.append(result["reports"])
                latest = _profile(model, batch, kwargs)
                write_json(out / f"{name}.p{p}.r{r}.after.profile.json", latest)
                sims.append([_simulated(plan, latest, cluster) for plan in plans])
            for i, plan in enumerate(plans):
                per_round = []
                for r in range(args.rounds):
                    measured_r = statistics.median(x["step_time_s"] for x in rounds[r][i])
                    pre, post = sims[r][i], sims[r + 1][i]
                    per_round.append((measured_r, (pre + post) / 2, post / pre - 1))
                    raw.append({"model": name, "stages": p, "m": plan.microbatches,
                                "checkpoint": plan.checkpoint, "round": r,
                                "measured_ms": measured_r * 1e3, "before_ms": pre * 1e3,
                                "after_ms": post * 1e3})  # fmt: skip
                measured = statistics.median(x[0] for x in per_round)
                predicted = plan.simulated_step_time_s or plan.step_time_s
                row = {
                    "model": name, "stages": p, "m": plan.microbatches,
                    "checkpoint": plan.checkpoint,
                    "closed_form_ms": plan.step_time_s * 1e3,
                    "predicted_ms": predicted * 1e3,
                    "bracketed_ms": statistics.median(x[1] for x in per_round) * 1e3,
                    "measured_ms": measured * 1e3,
                    "error": measured / predicted - 1,
                    "bracketed_error": statistics.median(x[0] / x[1] for x in per_round) - 1,
                    "drift": statistics.median(x[2] for x in per_round),
                }  # fmt: skip
                reports = [x for r in range(args.rounds) for x in rounds[r][i]]
                for j, st in enumerate(plan.stages):
                    f = statistics.median(x for r in reports for x in r["stages"][j]["forward_s"])
                    b = statistics.median(x for r in reports for x in r["stages"][j]["backward_s"])
                    row[f"s{j}_fwd_error"] = f / st.forward_s - 1
                    row[f"s{j}_bwd_error"] = b / st.backward_s - 1
                rows.append(row)
                print(
                    f"{name} p={p} m={plan.microbatches} {plan.checkpoint:11s} "
                    f"predicted {row['predicted_ms']:8.2f} ms measured {row['measured_ms']:8.2f} "
                    f"ms ({row['error']:+.1%}, bracketed {row['bracketed_error']:+.1%}, "
                    f"drift {row['drift']:+.1%})",
                    flush=True,
                )
    pd.DataFrame(raw).to_csv(out / "rounds.csv", index=False)
    df = pd.DataFrame(rows)
    df.to_csv(out / "results.csv", index=False)
    stage_cols = [c for c in df.columns if c.endswith("_error") and c.startswith("s")]
    stage_err = df[stage_cols].abs().stack()
    overlap = (df["stages"] > 1) & (df["m"] > 1)
    for col in ("error", "bracketed_error"):
        err = df[col].abs()
        print(
            f"\n{col}: median |error| {err.median():.1%}, worst {err.max():.1%} "
            f"({len(df)} configurations); no overlap {err[~overlap].median():.1%}, "
            f"overlap {err[overlap].median():.1%}"
        )
    print(
        f"drift between bracketing profiles: median |drift| {df['drift'].abs().median():.1%}, "
        f"worst {df['drift'].abs().max():.1%}"
    )
    print(f"stage F/B: median |error| {stage_err.median():.1%}, worst {stage_err.max():.1%}")
    print(
        df.groupby("model")[["error", "bracketed_error"]]
        .agg(lambda e: e.abs().median())
        .to_string()
    )
    table = df[
        [
            "model",
            "stages",
            "m",
            "checkpoint",
            "closed_form_ms",
            "predicted_ms",
            "bracketed_ms",
            "measured_ms",
            "error",
            "bracketed_error",
            "drift",
        ]
    ]
    ms = ("closed_form_ms", "predicted_ms", "bracketed_ms", "measured_ms")
    pct = ("error", "bracketed_error", "drift")
    table = table.assign(
        **{c: table[c].round(2) for c in ms},
        **{c: table[c].map(lambda e: f"{e:+.1%}") for c in pct},
    )
    print(to_markdown(table))


if __name__ == "__main__":
    main()
