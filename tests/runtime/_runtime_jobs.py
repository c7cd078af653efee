"""Helpers for the runtime tests: hand-made plans, and a multi-rank job run under torchrun.

The job (``python -m torch.distributed.run ... _runtime_jobs.py job.json``) builds each of its
models, traces it once, and for every configuration in the job file (checkpoint policy, schedule,
optimizer) resets the parameters, runs one pipelined step and records the loss and every
parameter's gradient, then runs more optimizer steps and records the parameters.  Each rank
writes ``rank<r>.pt``; the test compares them with the unsplit model in its own process.
Batching all configurations into one launch keeps the suite fast (a launch costs seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipeplan.intake.graph import group_units
from pipeplan.intake.model import ModelSpec, load_model
from pipeplan.intake.trace import TracedModel, trace_model
from pipeplan.planner.costmodel import recomputes
from pipeplan.planner.types import Cluster, MemoryBreakdown, Plan, Stage

POLICIES = ("always", "except_last", "never")


def make_plan(
    model: str,
    kwargs: dict[str, Any],
    traced: TracedModel,
    *,
    starts: Sequence[int],
    batch_size: int,
    microbatches: int,
    checkpoint: str = "except_last",
    schedule: str = "gpipe",
    dtype: str = "float64",
    optimizer: str = "sgd",
    replicas: int = 1,
    recompute: Sequence[bool] | None = None,
) -> Plan:
    """A plan whose stages start at units ``starts`` (first 0), with made-up costs; with
    ``replicas`` d, each of d pipelines takes ``batch_size / d`` of the global batch."""
    units = group_units(traced)
    n, p = len(units), len(starts)
    mem = MemoryBreakdown(
        params=0, grads=0, optimizer=0, stashed_inputs=0, activations=0, total=1 << 20
    )
    stages = []
    for j, lo in enumerate(starts):
        hi = (starts[j + 1] if j + 1 < p else n) - 1
        stages.append(
            Stage(
                index=j,
                device=f"dev{j}",
                first_unit=lo,
                last_unit=hi,
                unit_names=tuple(u.name for u in units[lo : hi + 1]),
                recompute=recomputes(checkpoint, j, p) if recompute is None else recompute[j],
                forward_s=1e-3,
                backward_s=2e-3,
                comm_s=0.0,
                time_s=3e-3,
                memory=mem,
                memory_limit=1 << 30,
                feasible=True,
            )
        )
    return Plan(
        model=model,
        model_kwargs=kwargs,
        profile_fingerprint="test",
        graph_fingerprint=traced.fingerprint,
        tracer=traced.tracer,
        dtype=dtype,
        batch_size=batch_size // replicas,
        microbatches=microbatches,
        microbatch_size=batch_size // replicas // microbatches,
        schedule=schedule,  # type: ignore[arg-type]
        checkpoint=checkpoint,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        cluster=Cluster.homogeneous(p, 1 << 30).model_copy(update={"data_parallel": replicas}),
        stages=tuple(stages),
        step_time_s=3e-3 * (p + microbatches - 1),
        bubble_fraction=(p - 1) / (microbatches + p - 1),
        throughput=1.0,
        feasible=True,
        solver="test",
        status="heuristic",
    )


def build(model: dict[str, Any], job: dict[str, Any]) -> tuple[ModelSpec, TracedModel]:
    """The model in its ``dtype`` (default float64) and its trace."""
    dtype = getattr(torch, model.get("dtype", "float64"))
    spec = load_model(model["model"], model["kwargs"])
    spec.module.to(dtype)
    inputs, _ = spec.batch(job["batch_size"] // job["microbatches"] // model.get("replicas", 1))
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return spec, trace_model(spec.module, inputs)


def _run_model(model: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    from pipeplan.runtime.engine import PipelineRunner, Recompute

    spec, traced = build(model, job)
    initial = {k: v.clone() for k, v in spec.module.state_dict().items()}
    inputs, target = spec.batch(job["batch_size"])
    results: dict[str, Any] = {}
    for cfg in job["configs"]:
        if cfg["key"] not in model.get("keys", [cfg["key"]]):  # a model may run only some
            continue
        spec.module.load_state_dict(initial)
        plan = make_plan(
            model["model"],
            model["kwargs"],
            traced,
            starts=model["starts"],
            batch_size=job["batch_size"],
            microbatches=job["microbatches"],
            checkpoint=cfg["checkpoint"],
            schedule=cfg["schedule"],
            dtype=model.get("dtype", "float64"),
            replicas=model.get("replicas", 1),
            # "odd": stages 1, 3, ... recompute and the others keep (a mix no fixed policy makes)
            recompute=[j % 2 == 1 for j in range(len(model["starts"]))]
            if cfg.get("recompute") == "odd"
            else None,
        )
        if "ranks" in cfg:  # the stages as the chunks of a multi-chunk family on that many ranks
            plan = chunked(plan, cfg["schedule"], cfg["ranks"])
        if "tp" in model:  # the stages split over that many tensor-parallel ranks
            cluster = plan.cluster.model_copy(update={"tensor_parallel": model["tp"]})
            plan = plan.model_copy(update={"cluster": cluster})
        for split in ("sequence_parallel", "loss_parallel"):  # the sequence, the loss's logits
            if cfg.get(split):
                plan = plan.model_copy(
                    update={"cluster": plan.cluster.model_copy(update={split: True})}
                )
        if "mode" in cfg:  # replicate or shard (FSDP2) over the replicas
            plan = plan.model_copy(
                update={
                    "cluster": plan.cluster.model_copy(update={"data_parallel_mode": cfg["mode"]})
                }
            )
        runner = PipelineRunner(
            plan,
            spec,
            device=torch.device("cpu"),
            optimizer=cfg["optimizer"],
            lr=cfg["lr"],
            traced=traced,
            batch_norm=cfg.get("batch_norm", "deferred"),
        )
        loss = runner.forward_backward(inputs, target)
        params = runner.named_parameters()
        grads = {k: _full(p.grad) for k, p in params.items() if p.grad is not None}
        runner.optimizer_step()
        losses = [loss]
        for step in range(1, cfg["steps"]):
            losses.append(runner.forward_backward(inputs, target, step))
            runner.optimizer_step()
        results[cfg["key"]] = {
            "loss": loss,
            "losses": losses,
            "grads": grads,
            "params": {k: _full(p) for k, p in params.items()},
            "sharded": [type(p).__name__ for p in params.values()],
            "tied": [(t.name, t.stages) for t in runner.tied],
            "recomputed": isinstance(runner.stage.submod, Recompute),
            "buffers": _stage_buffers(spec.module, runner.stage_module),
            "sent": [tuple(m.shape) for st in runner.stages for m in st._user_meta.outputs or ()],
            "received": [
                tuple(m.shape)
                for st in runner.stages
                for m in st._user_meta.inputs or ()
                if st.stage_index
            ],
            "sequence": [
                type(m).__name__
                for m in runner.stage_module.modules()
                if type(m).__name__ == "SequenceComm"
            ],
        }
    return results


def _full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor: a sharded (FSDP2) one gathered over its replicas."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor().clone() if isinstance(t, DTensor) else t.clone()


def _stage_buffers(model: torch.nn.Module, stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stage's buffers (batch-norm statistics) under the model's qualified names."""
    names = {id(b): n for n, b in model.named_buffers()}
    return {names[id(b)]: b.detach().clone() for b in stage.buffers() if id(b) in names}


def run_job(job_file: str) -> None:
    """Every model of the job on this rank; writes ``rank<r>.pt`` (model name -> results)."""
    import torch.distributed as dist

    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {m["name"]: _run_model(m, job) for m in job["models"]}
    torch.save(results, Path(job["out"]) / f"rank{rank}.pt")
    dist.destroy_process_group()


def launch_job(job: dict[str, Any], world: int, out: Path, timeout: float = 240) -> list[Any]:
    """Run ``job`` on ``world`` ranks; return each rank's results."""
    job = {**job, "out": str(out)}
    job_file = out / "job.json"
    job_file.write_text(json.dumps(job))
    cmd = [
        sys.executable,
        "-m",
        "pipeplan.runtime.forkrun",
        "--standalone",
        "--nproc-per-node",
        str(world),
        __file__,
        str(job_file),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env
    )
    if proc.returncode != 0:
        raise AssertionError(f"job failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def reference(
    model: dict[str, Any], batch_size: int, optimizer: str, lr: float, steps: int
) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]]:
    """Unsplit model, full batch: loss and gradients of step 1, parameters after ``steps``."""
    spec = load_model(model["model"], model["kwargs"])
    module = spec.module.double()
    inputs, target = spec.batch(batch_size)
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    named = dict(module.named_parameters())
    opt = {
        "sgd": lambda: torch.optim.SGD(module.parameters(), lr=lr),
        "momentum": lambda: torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9),
        "adam": lambda: torch.optim.Adam(module.parameters(), lr=lr),
    }[optimizer]()
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = spec.loss(module(*inputs), target)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in named.items() if p.grad is not None}
        opt.step()
    params = {k: p.detach().clone() for k, p in named.items()}
    return losses[0], grads, params, losses


def refused_run(
    model: tuple[str, dict[str, Any]], folder: Path, capsys: Any, **cluster: Any
) -> str:
    """A one-stage float32 plan of ``model`` (batch 4, m = 2) with ``cluster``'s fields, run by
    ``pipeplan run``: it must stop with status 2 and one line, no traceback; that line."""
    from pipeplan.cli import main
    from pipeplan.planner.io import write_json

    spec = load_model(*model)
    traced = trace_model(spec.module, spec.batch(2)[0])
    plan = make_plan(*model, traced, starts=[0], batch_size=4, microbatches=2, dtype="float32")
    path = folder / "plan.json"
    write_json(path, plan.model_copy(update={"cluster": plan.cluster.model_copy(update=cluster)}))
    try:
        main(["run", str(path), "--steps", "1"])
    except SystemExit as exc:
        assert exc.code == 2, exc.code
    else:
        raise AssertionError("the run did not stop")
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return " ".join(err.split())


def chunked(plan: Plan, schedule: str, p: int) -> Plan:
    """``plan``'s stages as the chunks of a ``schedule`` plan on p ranks, with made-up I and W
    times (half the backward each)."""
    stages = tuple(s.model_copy(update={"backward_input_s": s.backward_s / 2,
                                        "backward_weight_s": s.backward_s / 2})
                   for s in plan.stages)  # fmt: skip
    return plan.model_copy(update={
        "schedule": schedule, "stages_per_rank": len(plan.stages) // p, "stages": stages,
        "cluster": plan.cluster.model_copy(update={"devices": plan.cluster.devices[:p]}),
    })  # fmt: skip


if __name__ == "__main__":
    run_job(sys.argv[1])
