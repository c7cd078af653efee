"""One step of each multi-chunk plan on torch's schedule classes (run by torchrun from
test_chunked.py).

``python _chunked_job.py BATCH OUT PLAN...``: for every plan, every rank builds the GPT with
seed 3, runs :func:`pipeplan.runtime.chunked.chunked_step` and writes
``OUT/<schedule>-rank<r>.pt`` = {"grads": {name: grad}, "loss": float | None}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pipeplan
from pipeplan.intake.model import load_model
from pipeplan.runtime.chunked import chunked_step


def main(batch_file: str, out: str, *plans: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    inputs, target = torch.load(batch_file)
    for plan_file in plans:
        plan = pipeplan.load(plan_file)
        assert isinstance(plan, pipeplan.Plan)
        torch.manual_seed(3)
        spec = load_model(plan.model, dict(plan.model_kwargs))
        loss, grads = chunked_step(plan, spec, inputs, target)
        torch.save(
            {"grads": grads, "loss": loss},
            Path(out) / f"{Path(plan_file).stem}-rank{dist.get_rank()}.pt",
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
