"""One step of each multi-chunk plan on torch's schedule classes (run by torchrun from
test_engine.py and tests/zoo/test_chunked_zoo.py).

``python _chunked_job.py BATCH OUT PLAN...`` (BATCH: ``{model: (inputs, target)}``, each
plan's full batch by its ``model``): every rank builds each plan's model with seed 3
in the plan's dtype and traces it on one micro-batch, once for all the plans that share them
(tracing a ``transformers`` model takes seconds; each later plan starts from the same
parameters again), runs :func:`_chunked.chunked_step` and writes
``OUT/<schedule>-rank<r>.pt`` = {"grads": {name: grad}, "loss": float | None}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _chunked import chunked_step

import pipeplan
from pipeplan.intake.model import ModelSpec, load_model
from pipeplan.intake.spec import cast_batch
from pipeplan.intake.trace import TracedModel, trace_model


def main(batch_file: str, out: str, *plans: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batches = torch.load(batch_file)
    built: dict[str, tuple[ModelSpec, TracedModel, dict[str, Any]]] = {}
    for plan_file in plans:
        plan = pipeplan.load(plan_file)
        assert isinstance(plan, pipeplan.Plan)
        key = json.dumps([plan.model, plan.model_kwargs, plan.dtype, plan.microbatch_size])
        if key not in built:
            torch.manual_seed(3)
            spec = load_model(plan.model, dict(plan.model_kwargs))
            dtype = getattr(torch, plan.dtype)
            spec.module.to(dtype)
            micro = cast_batch(*spec.batch(plan.microbatch_size), dtype, torch.device("cpu"))[0]
            traced = trace_model(spec.module, micro, tracer=plan.tracer)
            built[key] = (spec, traced, {k: v.clone() for k, v in spec.module.state_dict().items()})
        spec, traced, initial = built[key]
        spec.module.load_state_dict(initial)
        loss, grads = chunked_step(plan, spec, *batches[plan.model], traced)
        torch.save(
            {"grads": grads, "loss": loss},
            Path(out) / f"{Path(plan_file).stem}-rank{dist.get_rank()}.pt",
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
