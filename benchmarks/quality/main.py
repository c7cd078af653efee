"""Measured plan quality: the DP's 2-stage plan against the baselines', run through the runtime.

    PYTHONPATH=. .venv/bin/python -m benchmarks.quality.main [--rounds 7] [--steps 15]

1. ``pipeplan calibrate --nproc 2 --threads 1`` once (link + engine cost per operation).
2. Per model (see ``MODELS``): profile with one thread per rank, plan 2 stages with ``dp``
   (micro-batch count chosen by the DP), then ``uniform``, ``params`` and ``torchgpipe`` at the
   DP's m.  Plans with the same partition (and m) are run once and reported under every name.
3. One torchrun job per model, 2 ranks, ``--threads 1``: every distinct plan gets a
   :class:`pipeplan.runtime.engine.PipelineRunner` (the engine ``pipeplan run`` uses), then the plans
   run round-robin, ``--rounds`` rounds of ``--warmup`` + ``--steps`` steps each, and every
   (plan, round) becomes a :class:`pipeplan.planner.types.RunReport` (``pipeplan.runtime.records.build_report``).
4. Per plan: predicted step time (the simulated makespan of the plan's stage times; the
   closed form T(m), the solvers' objective, beside it), measured step time (median over rounds
   of each round's median), measured / predicted, measured / the DP plan's measured, the
   paired ratio (median over rounds of the plan's round median / the DP plan's in the same
   round, which cancels the host's slow phases), and per-stage forward and
   backward per micro-batch measured vs predicted.  ``results.json`` (next to this file) keeps
   the numbers; profiles, plans and reports stay in ``--out``.

Plans use the CLI's defaults (checkpoint ``except_last``, GPipe, Adam) and the runs train with the
plan's optimizer, as ``pipeplan run`` does by default; the plans charge its update time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[2]

#: name -> (model, model kwargs, batch size).  Each step is ~50-250 ms on one EPYC core.
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt (vocab 16384, 8 blocks)": (
        "pipeplan.models.gpt:gpt", {"vocab": 16384, "n_layers": 8}, 8,
    ),
    "uneven CNN": ("benchmarks.quality.models:uneven", {}, 32),
    "uneven MLP": ("benchmarks.quality.models:uneven_mlp", {}, 128),
}  # fmt: skip
BASELINES = ("uniform", "params", "torchgpipe")


# -- driver ------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _partition(plan: Any) -> tuple[Any, ...]:
    return (plan.microbatches, tuple((s.first_unit, s.last_unit, s.recompute) for s in plan.stages))


def make_plans(name: str, out: Path, cluster: Any, repeats: int) -> dict[str, Path]:
    """Profile one model, plan it with the DP and every baseline; solver -> plan file."""
    from pipeplan.planner.io import write_json
    from pipeplan.planner.types import PlanOptions
    from pipeplan.profiler import profile_model
    from pipeplan.solvers import SOLVERS

    model, kwargs, batch = MODELS[name]
    prof = profile_model(
        model, batch_size=batch, model_kwargs=kwargs, threads=1, progress=False, repeats=repeats
    )
    slug = name.split()[0] if name.startswith("gpt") else name.replace(" ", "_")
    write_json(out / f"{slug}.profile.json", prof)
    plans: dict[str, Path] = {}
    dp = SOLVERS["dp"](prof, cluster, PlanOptions(checkpoint="except_last"))
    for solver in ("dp", *BASELINES):
        plan = (
            dp
            if solver == "dp"
            else SOLVERS[solver](
                prof, cluster, PlanOptions(checkpoint="except_last", microbatches=dp.microbatches)
            )
        )
        plan = plan.model_copy(update={"solve_time_s": None})
        path = out / f"{slug}.{solver}.plan.json"
        write_json(path, plan)
        plans[solver] = path
    return plans


def run_model(plan_files: list[Path], out: Path, rounds: int, steps: int, warmup: int) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--monitor-interval", "0.1", "-m", "benchmarks.quality.main", "--worker",
        "--rounds", str(rounds), "--steps", str(steps), "--warmup", str(warmup),
        "--out", str(out), *map(str, plan_files),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True)


def summarize(name: str, plans: dict[str, Path], out: Path) -> dict[str, Any]:
    from pipeplan.planner.io import load_plan, load_report
    from pipeplan.planner.replay import replay_plan

    loaded = {s: load_plan(p) for s, p in plans.items()}
    keys = {s: _partition(p) for s, p in loaded.items()}
    rows: dict[str, Any] = {}
    for solver, plan in loaded.items():
        runner = next(s for s in loaded if keys[s] == keys[solver])  # first with this partition
        reports = sorted(
            out.glob(f"{plans[runner].stem}.round*.report.json"),
            key=lambda f: int(f.name.split(".round")[1].split(".")[0]),
        )
        reps = [load_report(r) for r in reports]
        medians = [r.step_time_s for r in reps]
        measured = statistics.median(medians)
        stages: list[dict[str, Any]] = []
        measured_fb: list[tuple[float, float]] = []
        for j, st in enumerate(plan.stages):
            f = statistics.median(statistics.mean(r.stages[j].forward_s) for r in reps)
            b = statistics.median(statistics.mean(r.stages[j].backward_s) for r in reps)
            measured_fb.append((f, b))
            stages.append({
                "units": f"{st.first_unit}-{st.last_unit}", "recompute": st.recompute,
                "F_pred_ms": st.forward_s * 1e3, "F_meas_ms": f * 1e3,
                "B_pred_ms": st.backward_s * 1e3, "B_meas_ms": b * 1e3,
                "C_pred_ms": st.comm_s * 1e3,
            })  # fmt: skip
        m = plan.microbatches
        sim_profile = replay_plan(plan, timeline=False).makespan_s
        as_measured = tuple(
            st.model_copy(update={"forward_s": fb[0], "backward_s": fb[1], "update_s": 0.0})
            for st, fb in zip(plan.stages, measured_fb, strict=True)
        )
        measured_plan = plan.model_copy(update={"stages": as_measured})
        sim_measured = replay_plan(measured_plan, timeline=False).makespan_s
        tails, losses = [], []
        for r in reps:  # events: the last measured step of each round
            b_end = max(float(e["end_s"]) for e in r.events if str(e["name"]).startswith("B"))
            tails.append(max(float(e["end_s"]) for e in r.events) - b_end)
            losses += [float(e["end_s"]) - float(e["start_s"]) for e in r.events
                       if e["name"] == "loss"]  # fmt: skip
        rows[solver] = {
            "tail_ms": statistics.median(tails) * 1e3,
            "loss_fwd_ms": statistics.median(losses) * 1e3 if losses else 0.0,
            "sim_profile_ms": sim_profile * 1e3,
            "sim_measured_ms": sim_measured * 1e3,
            "partition": " | ".join(f"{s.first_unit}-{s.last_unit}" for s in plan.stages),
            "m": m,
            "same_as": runner if runner != solver else None,
            "predicted_ms": sim_profile * 1e3,
            "closed_form_ms": plan.step_time_s * 1e3,
            "work_pred_ms": m * sum(s.forward_s + s.backward_s for s in plan.stages) * 1e3,
            "measured_ms": measured * 1e3,
            "round_medians_ms": [t * 1e3 for t in medians],
            "stages": stages,
        }
    dp = rows["dp"]["measured_ms"]
    for row in rows.values():
        row["meas_over_pred"] = row["measured_ms"] / row["predicted_ms"]
        row["meas_over_dp"] = row["measured_ms"] / dp
        # The plans run interleaved, so a round's slow phase hits all of them: pair them.
        pairs = zip(row["round_medians_ms"], rows["dp"]["round_medians_ms"], strict=True)
        row["paired_over_dp"] = statistics.median(a / b for a, b in pairs)
    return {"model": name, "spec": MODELS[name], "plans": rows}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| model | plan | partition (m) | T(m) ms | predicted ms | measured ms "
            "| measured / predicted | measured / DP | paired / DP | work ms | rounds (ms) |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for res in results:
        for solver, r in res["plans"].items():
            same = f" = {r['same_as']}" if r["same_as"] else ""
            rounds = ", ".join(f"{t:.0f}" for t in r["round_medians_ms"])
            cut = r["partition"].replace("|", "\\|")  # a literal | inside a Markdown cell
            lines.append(
                f"| {res['model']} | {solver}{same} | {cut} ({r['m']}) "
                f"| {r['closed_form_ms']:.1f} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} "
                f"| {r['meas_over_pred']:.2f} | {r['meas_over_dp']:.3f} "
                f"| {r['paired_over_dp']:.3f} | {r['work_pred_ms']:.1f} | {rounds} |"
            )
    lines += [
        "",
        (
            "Where the time goes (ms): the cost model's T(m); the GPipe simulator on the "
            "profile's stage times; the simulator on the measured per-stage F/B (F includes "
            "the loss); the measured tail after the last backward (tied-gradient all-reduce + "
            "optimizer step; last step of each round, median); the measured step."
        ),
        "",
        (
            "| model | plan | T(m) | sim(profile) | sim(measured F/B) | + tail | = | measured "
            "| loss fwd per micro-batch |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for solver, r in res["plans"].items():
            if r["same_as"]:
                continue
            lines.append(
                f"| {res['model']} | {solver} | {r['closed_form_ms']:.1f} "
                f"| {r['sim_profile_ms']:.1f} "
                f"| {r['sim_measured_ms']:.1f} | {r['tail_ms']:.1f} "
                f"| {r['sim_measured_ms'] + r['tail_ms']:.1f} | {r['measured_ms']:.1f} "
                f"| {r['loss_fwd_ms']:.2f} |"
            )
    lines += ["", "Per stage, per micro-batch (median over rounds of the per-run mean):", "",
              "| model | plan | stage | units | F pred | F meas | B pred | B meas |",
              "|---|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for res in results:
        for solver, r in res["plans"].items():
            if r["same_as"]:
                continue
            for j, s in enumerate(r["stages"]):
                rc = " (recompute)" if s["recompute"] else ""
                lines.append(
                    f"| {res['model']} | {solver} | {j} | {s['units']}{rc} | {s['F_pred_ms']:.2f} "
                    f"| {s['F_meas_ms']:.2f} | {s['B_pred_ms']:.2f} | {s['B_meas_ms']:.2f} |"
                )
    return "\n".join(lines) + "\n"


def driver(args: argparse.Namespace) -> None:
    from pipeplan.planner.io import load_cluster

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    info = machine()
    t0 = time.perf_counter()
    cluster_path = out / "cluster.json"
    subprocess.run(
        [str(Path(sys.executable).with_name("pipeplan")), "calibrate", "--nproc", "2",
         "--threads", "1", "-o", str(cluster_path)],
        cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    cluster = load_cluster(cluster_path)
    link = cluster.link
    print(
        f"calibrated: latency {link.latency_s * 1e6:.0f} us, "
        f"bandwidth {(link.bandwidth_Bps or 0) / 1e9:.2f} GB/s, "
        f"engine cost {cluster.op_overhead_s * 1e6:.0f} us per op",
        flush=True,
    )
    results = []
    for name in args.models or list(MODELS):
        plans = make_plans(name, out, cluster, args.profile_repeats)
        distinct: dict[tuple[Any, ...], Path] = {}
        from pipeplan.planner.io import load_plan

        for path in plans.values():
            distinct.setdefault(_partition(load_plan(path)), path)
        print(f"{name}: {len(distinct)} distinct plans of {len(plans)}", flush=True)
        run_model(list(distinct.values()), out, args.rounds, args.steps, args.warmup)
        res = summarize(name, plans, out)
        results.append(res)
        print(markdown([res]), flush=True)
    info["uptime_after"] = subprocess.run(
        ["uptime"], capture_output=True, text=True, check=False
    ).stdout.strip()
    info["elapsed_s"] = f"{time.perf_counter() - t0:.0f}"
    info["command"] = " ".join(["python -m benchmarks.quality.main", *sys.argv[1:]])
    summary = {
        "machine": info,
        "cluster": {
            "latency_us": link.latency_s * 1e6,
            "bandwidth_GBps": (link.bandwidth_Bps or 0) / 1e9,
            "op_overhead_us": cluster.op_overhead_s * 1e6,
            "contention": cluster.contention,
            "update_contention": cluster.update_contention,
        },
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "results": results,
    }  # fmt: skip
    Path(args.results).write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(results))
    print(json.dumps(info, indent=1))


# -- worker (one rank; run under torchrun by the driver) ----------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from pipeplan.intake.model import load_model
    from pipeplan.planner.allocator import keep_heap
    from pipeplan.planner.io import load_plan, write_json
    from pipeplan.runtime.engine import PipelineRunner
    from pipeplan.runtime.records import RankRecord, gather_report

    keep_heap()  # as pipeplan run's ranks do
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs = []
    for path in args.plans:
        plan = load_plan(path)
        torch.manual_seed(0)
        spec = load_model(plan.model, dict(plan.model_kwargs))
        runner = PipelineRunner(plan, spec, device=torch.device("cpu"), optimizer=plan.optimizer)
        torch.manual_seed(1)
        runs.append((Path(path), plan, runner, spec.batch(plan.batch_size)))
    for rnd in range(args.rounds):
        for path, plan, runner, (inputs, target) in runs:
            record = runner.measure(
                inputs, target, RankRecord(stage=rank, threads=1),
                warmup=args.warmup, steps=args.steps,
            )  # fmt: skip
            report = gather_report(plan, record, backend="gloo", warmup_steps=args.warmup)
            if report is not None:
                stem = path.name.removesuffix(".json")
                write_json(Path(args.out) / f"{stem}.round{rnd}.report.json", report)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=15, help="measured steps per plan per round")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per plan per round")
    ap.add_argument("--profile-repeats", type=int, default=9)
    ap.add_argument("--models", nargs="*", choices=list(MODELS), help="default: all")
    ap.add_argument("--out", default="/tmp/pipeplan-quality", help="profiles, plans, reports")
    ap.add_argument("--results", default=str(Path(__file__).with_name("results.json")))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("plans", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
