"""DeepSpeed's own PipelineModule builds a pipeplan export (run as a script by test_deepspeed.py).

``python ds_pipeline.py RANK WORLD PORT JOBS.json``: one gloo rank (``deepspeed.init_distributed``
on gloo, CPU).  JOBS.json lists ``{"model", "kwargs", "export"}``; for each it loads the model
(pipeplan's loader), imports the exported module and builds its ``pipeline_module`` with
DeepSpeed 0.19.  Rank 1 first shifts the model's
tied weights, so that only DeepSpeed's broadcast can make the ranks agree.  Prints one JSON
line: the model's parameter names this rank's PipelineModule holds, the stage's layers, the
tie keys, whether every tied weight equals rank 0's after the build, and the tied gradients
after DeepSpeed's all-reduce of gradients rank + 1, per job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pipeplan  # noqa: F401  (defines torchvision's op schemas before transformers imports it)


def main(rank: int, world: int, port: int, jobs: str) -> list[dict[str, Any]]:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    with open(jobs) as f:
        return [_build(rank, world, **job) for job in json.load(f)]


def _build(
    rank: int, world: int, model: str, kwargs: dict[str, Any], export: str
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from pipeplan.intake.model import NamedInputs, load_model

    module = load_model(model, kwargs).module
    root = module.model if isinstance(module, NamedInputs) else module
    spec = importlib.util.spec_from_file_location(Path(export).stem, export)
    assert spec is not None and spec.loader is not None
    planned = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planned)
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    if rank == 1:  # tied weights that only DeepSpeed's broadcast can bring back to rank 0's
        with torch.no_grad():
            for param in root.parameters():
                if len(names[id(param)]) > 1:
                    param.add_(1.0)
    net = planned.pipeline_module(root)
    stage = net.stage_id
    out: dict[str, Any] = {
        "rank": rank,
        "stage": stage,
        "layers": planned.LAYERS[planned.PARTS[stage] : planned.PARTS[stage + 1]],
        "held": sorted({names[id(p)][0] for p in net.parameters()}),
        "tie_keys": sorted(net.tied_comms),
    }
    same = []
    grads = []
    for key in sorted(net.tied_comms):
        comm = net.tied_comms[key]
        for attr in comm["weight_attr"]:
            weight = net._recursive_getattr(net.tied_modules[key], attr)
            copies = [torch.empty_like(weight) for _ in range(world)]
            dist.all_gather(copies, weight.detach())
            same.append(all(torch.equal(c, copies[0]) for c in copies))
            weight.grad = torch.full_like(weight, float(rank + 1))
    net.allreduce_tied_weight_gradients()
    for key in sorted(net.tied_comms):
        for attr in net.tied_comms[key]["weight_attr"]:
            grad = net._recursive_getattr(net.tied_modules[key], attr).grad
            grads.append(float(grad.flatten()[0]))
    out["tied_equal"] = same
    out["tied_grads"] = grads
    dist.barrier()
    return out


if __name__ == "__main__":
    r, w, port = (int(x) for x in sys.argv[1:4])
    print(json.dumps(main(r, w, port, sys.argv[4])))
