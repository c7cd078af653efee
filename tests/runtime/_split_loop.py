"""A training loop of a user's own on ``pipeplan.split`` (run by torchrun from test_stage_split.py).

``python _split_loop.py PLAN BATCH OUT``: every rank takes its stage, runs one GPipe step of
``torch.distributed.pipelining``'s own schedule on the batch in BATCH, syncs the gradients and
writes ``OUT/rank<r>.pt`` = {"grads": {name: grad}, "losses": [...], "stage": j}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleGPipe

import pipeplan


def main(plan_file: str, batch_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plan = pipeplan.load(plan_file)
    assert isinstance(plan, pipeplan.Plan)
    split = pipeplan.split(plan, seed=3)
    module, stage = split
    schedule = ScheduleGPipe(stage, n_microbatches=plan.microbatches, loss_fn=split.loss)
    inputs, target = torch.load(batch_file)
    losses: list[torch.Tensor] = []
    replica = dist.get_rank() // plan.n_stages
    share = plan.batch_size
    inputs = tuple(t[replica * share : (replica + 1) * share] for t in inputs)
    target = target[replica * share : (replica + 1) * share]
    last = split.index == plan.n_stages - 1
    schedule.step(  # the first stage takes the inputs, the last the target
        *(inputs if split.index == 0 else ()),
        **({"target": target, "losses": losses} if last else {}),
    )
    split.sync_gradients()
    grads = {name: p.grad.detach().clone() for name, p in split.named_parameters().items()}
    assert all(p.grad is not None for p in module.parameters())
    torch.save(
        {"grads": grads, "losses": [float(x) for x in losses], "stage": split.index},
        Path(out) / f"rank{dist.get_rank()}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
