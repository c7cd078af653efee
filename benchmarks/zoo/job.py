"""One torchrun job for the zoo: every case's 2-stage plan, 2 steps, in the plan's dtype, gloo.

``python -m torch.distributed.run --nproc-per-node 2 -m benchmarks.zoo.job job.json``: the job file lists
each case's model, kwargs, plan file and whether to build it as ``pipeplan run`` does by
default (``meta``: on meta, each rank materializing its stage, or the whole model where
something has no initializer, ``--init auto``).  Each rank writes ``rank<r>.pt``: case -> the losses
of the steps (last rank), the first step's gradients, and an error line if the case failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.intake.model import load_model
from pipeplan.planner.io import load_plan
from pipeplan.runtime.engine import PipelineRunner
from pipeplan.runtime.worker import _whole_build_needed


def _run_case(case: dict[str, Any], steps: int) -> dict[str, Any]:
    plan = load_plan(case["plan"])
    spec = load_model(case["model"], case["kwargs"], meta=case.get("meta", False))
    if case.get("meta") and _whole_build_needed(spec, dist.get_world_size(), dist.get_rank()):
        spec = load_model(case["model"], case["kwargs"])  # as pipeplan run's --init auto
    spec.module.to(getattr(torch, plan.dtype))
    runner = PipelineRunner(plan, spec, device=torch.device("cpu"), optimizer="sgd", lr=0.1)
    inputs, target = spec.batch(plan.batch_size)
    losses, grads = [], {}
    for step in range(steps):
        losses.append(runner.forward_backward(inputs, target, step))
        if step == 0:
            grads = {
                k: p.grad.detach().clone()
                for k, p in runner.named_parameters().items()
                if p.grad is not None
            }
        runner.optimizer_step()
    return {"losses": losses, "grads": grads, "tied": [t.name for t in runner.tied]}


def main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, case in job["cases"].items():
        try:
            out[name] = _run_case(case, job["steps"])
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
            torch.save(out, Path(job["out"]) / f"rank{dist.get_rank()}.pt")
            raise
    torch.save(out, Path(job["out"]) / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
