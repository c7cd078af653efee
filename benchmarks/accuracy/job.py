"""One torchrun job of the accuracy benchmark: run several plans of one model, interleaved.

    torchrun --nproc-per-node P -m benchmarks.accuracy.job --out results.json plan1.json ...

Every rank builds a :class:`pipeplan.runtime.engine.PipelineRunner` per plan (same model, same number of
stages) and then, for each of ``--rounds`` rounds, runs every plan for ``--warmup`` + ``--steps``
steps, so slow phases of a noisy machine spread over all plans.  Rank 0 writes one RunReport per
(plan, round).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from pipeplan.intake.model import load_model
from pipeplan.planner.allocator import keep_heap
from pipeplan.planner.io import load_plan
from pipeplan.runtime.engine import PipelineRunner
from pipeplan.runtime.records import RankRecord, gather_report
from pipeplan.runtime.worker import default_threads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    keep_heap()  # as pipeplan run's ranks do
    threads = args.threads or default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plans = [load_plan(p) for p in args.plans]
    runners, batches = [], []
    for plan in plans:
        torch.manual_seed(0)
        spec = load_model(plan.model, dict(plan.model_kwargs))
        runners.append(
            PipelineRunner(
                plan, spec, device=torch.device("cpu"), optimizer=plan.optimizer, lr=1e-4
            )
        )
        torch.manual_seed(1)
        batches.append(spec.batch(plan.batch_size))
    results: list[list[dict]] = [[] for _ in plans]
    for _ in range(args.rounds):
        for i, (plan, runner) in enumerate(zip(plans, runners)):
            inputs, target = batches[i]
            record = runner.measure(
                inputs, target, RankRecord(stage=rank, threads=threads),
                warmup=args.warmup, steps=args.steps,
            )  # fmt: skip
            report = gather_report(plan, record, backend="gloo", warmup_steps=args.warmup)
            if report is not None:
                results[i].append(report.model_dump(mode="json", by_alias=True, exclude={"events"}))
            dist.barrier()
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"plans": args.plans, "reports": results}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
