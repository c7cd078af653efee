"""Runtime overhead: pipeplan's pipeline engine against the same work without pipeplan.

    PYTHONPATH=. .venv/bin/python -m benchmarks.overhead.main [--rounds 20] [--steps 5] [--warmup 1]

Model ``pipeplan.models.mlp:mlp`` (width 1024, depth 8, 1024 inputs, 10 classes), batch 256, SGD, one
thread per process.  A step is the whole training step: zero the gradients, forward, loss,
backward, optimizer step.  Every step is timed from outside with ``time.perf_counter`` after a
barrier; on two ranks the step time is the slower rank's.

(a) 1 rank: a 1-stage plan (m = 1, no recomputation) run by
    :class:`pipeplan.runtime.engine.PipelineRunner` (``timed_step``, exactly what ``pipeplan run`` does
    per step) against a plain PyTorch loop on an identical model.
(b) 2 ranks: the 2-stage DP plan at m = 4 with ``--checkpoint never`` (so both sides do the same
    computation) run by ``PipelineRunner``, against the same cut hand-built with
    ``torch.distributed.pipelining``: ``PipelineStage`` + ``ScheduleGPipe`` on
    ``nn.Sequential`` slices of the model (``hand``), and on the plan's own stage modules from
    ``pipeplan.runtime.stages.build_stages`` with no pipeplan timers or wrappers (``hand+fx``).

The arms alternate inside one process (one torchrun job per part): ``--rounds`` rounds, each
running every arm for ``--warmup`` + ``--steps`` steps, the arm order reversed every other
round.  Reported: median over rounds of each round's median step, its ratio to the
reference arm's (plain / hand), and the median over rounds of the per-round ratio (the two arms
ran seconds apart, so drift of the shared VM cancels; this is the headline).  A second,
identical copy of the reference arm (``A/A copy``) shows the noise floor of that ratio.  ``results.json`` next to this file keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[2]
MODEL, KWARGS, BATCH, M = "pipeplan.models.mlp:mlp", {"width": 1024, "depth": 8}, 256, 4
LR = 1e-3


# -- driver ------------------------------------------------------------------------------------


def make_plans(out: Path) -> tuple[Path, Path]:
    """A 1-stage plan (m = 1) and a 2-stage DP plan (m = M, no recomputation)."""
    from pipeplan.planner.io import write_json
    from pipeplan.planner.types import Cluster, PlanOptions
    from pipeplan.profiler import profile_model
    from pipeplan.solvers import SOLVERS

    prof = profile_model(
        MODEL, batch_size=BATCH, model_kwargs=KWARGS, threads=1, progress=False,
        microbatch_sizes=[BATCH // M, BATCH], repeats=3,
    )  # fmt: skip
    one = SOLVERS["dp"](prof, Cluster.homogeneous(1, 2**36), PlanOptions(microbatches=1))
    two = SOLVERS["dp"](
        prof, Cluster.homogeneous(2, 2**36), PlanOptions(microbatches=M, checkpoint="never")
    )
    paths = out / "one.plan.json", out / "two.plan.json"
    for path, plan in zip(paths, (one, two)):
        write_json(path, plan.model_copy(update={"solve_time_s": None}))
    return paths


def torchrun(nproc: int, part: str, plan: Path, args: argparse.Namespace, out: Path) -> Any:
    result = out / f"{part}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), "--monitor-interval", "0.1", "-m", "benchmarks.overhead.main", "--worker",
        part, "--plan", str(plan), "--rounds", str(args.rounds), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--result", str(result),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return json.loads(result.read_text())


def summarize(arms: dict[str, list[list[float]]], reference: str) -> dict[str, Any]:
    """Per arm: each round's median step, their median, and the ratio to ``reference``."""
    rows: dict[str, dict[str, Any]] = {}
    for arm, rounds in arms.items():
        medians = [statistics.median(r) for r in rounds]
        rows[arm] = {"round_medians_ms": [t * 1e3 for t in medians],
                     "median_ms": statistics.median(medians) * 1e3}  # fmt: skip
    ref = rows[reference]["median_ms"]
    for arm, row in rows.items():
        row["ratio"] = row["median_ms"] / ref
        # Per-round ratio (same round, adjacent in time): less exposed to drift.
        row["round_ratios"] = [
            a / b for a, b in zip(row["round_medians_ms"], rows[reference]["round_medians_ms"])
        ]
        row["median_round_ratio"] = statistics.median(row["round_ratios"])
    return rows


def markdown(parts: dict[str, dict[str, Any]]) -> str:
    lines = [
        (
            "| part | arm | median step ms | ratio of medians | median per-round ratio "
            "| per-round ratio IQR |"
        ),
        "|---|---|---:|---:|---:|---|",
    ]
    for part, rows in parts.items():
        for arm, r in rows.items():
            q1, _, q3 = statistics.quantiles(r["round_ratios"], n=4)
            lines.append(
                f"| {part} | {arm} | {r['median_ms']:.2f} | {r['ratio']:.3f} "
                f"| {r['median_round_ratio']:.3f} | {q1:.3f}-{q3:.3f} |"
            )
    return "\n".join(lines) + "\n"


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    t0 = time.perf_counter()
    one, two = make_plans(out)
    a = torchrun(1, "single", one, args, out)
    b = torchrun(2, "pair", two, args, out)
    parts = {
        "(a) 1 rank, m=1": summarize(a["arms"], "plain"),
        f"(b) 2 ranks, m={M}, cut {b['cut']}": summarize(b["arms"], "hand"),
    }
    info["uptime_after"] = subprocess.run(
        ["uptime"], capture_output=True, text=True, check=False
    ).stdout.strip()
    info["elapsed_s"] = f"{time.perf_counter() - t0:.0f}"
    info["command"] = " ".join(["python -m benchmarks.overhead.main", *sys.argv[1:]])
    record = {"machine": info, "rounds": args.rounds, "steps": args.steps,
              "warmup": args.warmup, "parts": parts}  # fmt: skip
    Path(args.results).write_text(json.dumps(record, indent=1) + "\n")
    print(markdown(parts))
    print(json.dumps(info, indent=1))


# -- worker ------------------------------------------------------------------------------------


def _interleave(
    arms: dict[str, Callable[[], None]], args: argparse.Namespace
) -> dict[str, list[list[float]]]:
    """Run the arms round-robin; each step after a barrier, timed on this rank."""
    import torch.distributed as dist

    times: dict[str, list[list[float]]] = {name: [] for name in arms}
    names = list(arms)
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            step, walls = arms[name], []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                if i >= args.warmup:
                    walls.append(time.perf_counter() - t0)
            times[name].append(walls)
    return times


def _slowest(times: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """Every step's time as the slowest rank's (gathered on every rank)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    return {
        arm: [[max(ts) for ts in zip(*(t[arm][r] for t in every))] for r in range(len(rounds))]
        for arm, rounds in times.items()
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from pipeplan.intake.graph import group_units
    from pipeplan.intake.model import load_model
    from pipeplan.intake.trace import trace_model
    from pipeplan.planner.io import load_plan
    from pipeplan.runtime.engine import PipelineRunner
    from pipeplan.runtime.stages import build_stages

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = load_plan(args.plan)
    cpu = torch.device("cpu")

    def fresh() -> Any:
        torch.manual_seed(0)
        return load_model(MODEL, KWARGS)

    spec = fresh()
    runner = PipelineRunner(plan, spec, device=cpu, optimizer="sgd", lr=LR)
    inputs, target = spec.batch(BATCH)
    x = inputs[0]
    pipeplan_step = 0

    def pipeplan() -> None:
        nonlocal pipeplan_step
        runner.timed_step(inputs, target, pipeplan_step)
        pipeplan_step += 1

    arms: dict[str, Callable[[], None]] = {"pipeplan": pipeplan}
    result: dict[str, Any] = {}
    if args.worker == "single":

        def plain_loop() -> Callable[[], None]:
            model = fresh().module
            opt = torch.optim.SGD(model.parameters(), lr=LR)

            def plain() -> None:
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), target)
                loss.backward()
                opt.step()

            return plain

        arms["plain"] = plain_loop()
        arms["plain (A/A copy)"] = plain_loop()
    else:
        k = plan.stages[0].last_unit + 1  # units: layers.0..layers.{depth-1}, head
        mb = BATCH // plan.microbatches

        def gpipe(stage_module: nn.Module, example_in: Any, example_out: Any) -> Callable[[], None]:
            stage = PipelineStage(stage_module, rank, world, cpu,
                                  input_args=example_in, output_args=example_out)  # fmt: skip
            sched = ScheduleGPipe(stage, n_microbatches=plan.microbatches, loss_fn=F.cross_entropy)
            opt = torch.optim.SGD(list(stage_module.parameters()), lr=LR)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    sched.step(x, return_outputs=False)
                else:
                    sched.step(target=target, losses=[], return_outputs=False)
                opt.step()

            return step

        net = fresh().module
        width = net.layers[0].linear.out_features
        act = torch.zeros(mb, width, requires_grad=True)  # example of the tensor sent
        out = torch.zeros(mb, net.head.out_features, requires_grad=True)
        for arm in ("hand", "hand (A/A copy)"):
            net = fresh().module
            if rank == 0:
                arms[arm] = gpipe(nn.Sequential(*net.layers[:k]), (x[:mb],), (act,))
            else:
                arms[arm] = gpipe(nn.Sequential(*net.layers[k:], net.head), (act,), (out,))
        fx_spec = fresh()
        mb_in = (x[:mb],)
        traced = trace_model(fx_spec.module, mb_in, tracer=plan.tracer)
        prog = build_stages(
            plan, traced, group_units(traced, plan.granularity, plan.unit_expansions), mb_in
        )[rank]
        arms["hand+fx"] = gpipe(prog.module, prog.example_inputs, prog.example_outputs)
        first, second = plan.stages[0].unit_names, plan.stages[1].unit_names
        result["cut"] = f"{first[0]}..{first[-1]} / {second[0]}..{second[-1]}"
    times = _slowest(_interleave(arms, args))
    if rank == 0:
        result["arms"] = times
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per arm per round")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps per arm per round")
    ap.add_argument("--out", default="/tmp/pipeplan-overhead", help="plans and raw times")
    ap.add_argument("--results", default=str(Path(__file__).with_name("results.json")))
    ap.add_argument("--worker", choices=("single", "pair"), help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
