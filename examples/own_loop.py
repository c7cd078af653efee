"""Train with a pipeplan plan in a loop of your own.

    pipeplan profile pipeplan.models.gpt:gpt --batch-size 32 -o gpt.profile.json
    pipeplan plan gpt.profile.json --stages 2 --memory 256MiB -o gpt.plan.json
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py gpt.plan.json [STEPS]

Every rank takes its stage of the plan with :func:`pipeplan.split` (its chunks, for the
interleaved, zero-bubble and V schedules) and runs the plan's own
``torch.distributed.pipelining`` schedule and a torch optimizer on it.  A plan with
data-parallel replicas (``pipeplan plan --devices N``) runs the same way on N ranks.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import pipeplan
from pipeplan.intake.model import load_model


def main(plan_file: str, steps: int = 3) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    plan = pipeplan.load(plan_file)
    assert isinstance(plan, pipeplan.Plan), f"{plan_file} is not a plan"
    split = pipeplan.split(plan)  # this rank's stage (or chunks), initialised as the unsplit model
    schedule = (
        split.schedule
    )  # the plan's torch schedule: ScheduleGPipe, ..., ScheduleZBVZeroBubble
    optimizer = torch.optim.AdamW(split.module.parameters(), lr=1e-3)
    batches = load_model(plan.model, plan.model_kwargs, meta=True)  # only for make_batch
    first, last = split.is_first, split.is_last
    device = split.stage.device
    for step in range(steps):
        torch.manual_seed(step)  # every rank of a replica draws the same batch
        inputs, target = batches.batch(plan.batch_size)
        inputs = tuple(t.to(device) for t in inputs)
        losses: list[torch.Tensor] = []
        optimizer.zero_grad()
        args = inputs if first else ()  # the first stage takes the inputs, the last the target
        if last:
            schedule.step(*args, target=target.to(device), losses=losses)
        else:
            schedule.step(*args)
        split.sync_gradients()  # tied weights summed over stages, replicas averaged
        optimizer.step()
        if last:
            print(f"rank {dist.get_rank()} step {step}: loss {torch.stack(losses).mean():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
