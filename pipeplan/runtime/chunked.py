"""A multi-chunk plan (v chunks per rank: interleaved, looped, zero-bubble, V) on torch's own
schedule classes.

Every rank builds the model as the unsplit one (same seed), cuts it at the plan's p v chunk
boundaries (:func:`pipeplan.runtime.stages.build_stages`, the same cuts ``pipeplan run`` uses),
wraps its chunks (:func:`pipeplan.planner.schedules.stages_of_rank`: a loop, or a V) in
``PipelineStage`` s with static shapes, and runs the family's torch class on them, whose
``pipeline_order`` is exactly what the planner replayed.  Chunks of one rank share the
model's parameters, so a tied weight held twice on a rank sums its gradient by itself; one
held on several ranks is summed over them after the step (``sync_tied``).  The runner, not
torch's stages, divides the summed gradients by m (``scale_grads=False``): torch divides per
stage, which divides a weight two chunks of a rank share twice.

:func:`chunked_step` runs one forward and backward and hands back the loss and this rank's
gradients by the unsplit model's parameter names: what the equivalence tests compare.
``pipeplan run`` runs such a plan with :func:`launch_chunked`: torchrun, one rank per device,
each running :func:`main` (the optimizer's step after every pipelined step); the rank of the
last chunk prints each step's loss and time, and the median step beside the plan's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.microbatch import _CustomReducer

from pipeplan.intake.graph import group_units
from pipeplan.intake.model import ModelSpec
from pipeplan.intake.trace import TracedModel, trace_model
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.schedules import FAMILIES, stages_of_rank
from pipeplan.planner.types import Plan
from pipeplan.runtime.engine import Recompute, _dtype, cast_batch
from pipeplan.runtime.stages import build_stages, parameter_names, tied_parameters

__all__ = ["ChunkedRunner", "chunked_step", "launch_chunked", "main"]


@dataclass
class ChunkedRunner:
    """This rank's chunks of a multi-chunk plan and the torch schedule that runs them."""

    plan: Plan
    schedule: Any
    chunks: list[int]
    modules: list[nn.Module]
    names: dict[int, str]
    tied: list[tuple[str, tuple[int, ...]]]
    """(name, ranks holding it) of every tied parameter held on two or more ranks."""
    first: bool
    last: bool

    @classmethod
    def build(
        cls, plan: Plan, spec: ModelSpec, device: torch.device, traced: TracedModel | None = None
    ) -> ChunkedRunner:
        """This rank's runner; ``traced``: ``spec.module`` already traced on one micro-batch in
        the plan's dtype (several plans of one model trace it once)."""
        p, v = plan.cluster.n_stages, plan.stages_per_rank
        if plan.cluster.data_parallel != 1:
            raise InvalidRequestError("multi-chunk plans run one pipeline; plan with --stages")
        if dist.get_world_size() != p:
            raise InvalidRequestError(
                f"plan {plan.schedule} runs on {p} ranks; the world size is "
                f"{dist.get_world_size()} (--nproc-per-node {p})"
            )
        rank = dist.get_rank()
        dtype = _dtype(plan.dtype)
        module = spec.module.to(dtype=dtype)
        inputs, _ = cast_batch(*spec.batch(plan.microbatch_size), dtype, torch.device("cpu"))
        if traced is None:
            traced = trace_model(module, inputs, tracer=plan.tracer)
        units = group_units(traced, plan.granularity, plan.unit_expansions)
        programs = build_stages(plan, traced, units, inputs)
        names = parameter_names(module, traced.gm)
        owner = {s: r for r in range(p) for s in stages_of_rank(plan.schedule, p, v, r)}
        tied = []
        for t in tied_parameters([pr.module for pr in programs], names):
            ranks = tuple(sorted({owner[s] for s in t.stages}))
            if len(ranks) > 1:
                tied.append((t.name, ranks))
        chunks = stages_of_rank(plan.schedule, p, v, rank)
        n = p * v
        stages: list[PipelineStage] = []
        modules: list[nn.Module] = []
        for s in chunks:
            body = programs[s].module.to(device)
            mod: nn.Module = Recompute(body) if plan.stages[s].recompute else body
            modules.append(body)
            stages.append(
                PipelineStage(
                    mod,
                    s,
                    n,
                    device,
                    input_args=tuple(t.to(device) for t in programs[s].example_inputs),
                    output_args=tuple(t.to(device) for t in programs[s].example_outputs),
                )
            )
        last_body = programs[n - 1].module

        def loss(output: Any, target: Tensor) -> Tensor:
            return spec.loss(last_body.rebuild_output(output), target)

        cls_ = getattr(schedules, FAMILIES[plan.schedule].torch_class)
        # Each torch stage divides its parameters' gradients by m after its last backward; a
        # weight two chunks of one rank share (a tied embedding and head in a V) would be
        # divided twice, part way through its sum.  So the runner divides once, after the step.
        # The last stage's outputs are left unmerged: the loss is all the runner reads, and
        # torch's default merge concatenates every output on dim 0, which a 0-dim one lacks.
        drop = tuple(_CustomReducer(None, _drop) for _ in programs[n - 1].example_outputs)
        sched = cls_(
            stages[0] if v == 1 else stages,
            plan.microbatches,
            loss_fn=loss,
            output_merge_spec=drop,
            scale_grads=False,
        )
        return cls(plan, sched, chunks, modules, names, tied, 0 in chunks, n - 1 in chunks)

    def parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by their unsplit names (a tied one once)."""
        out: dict[str, nn.Parameter] = {}
        for m in self.modules:
            for prm in m.parameters():
                out.setdefault(self.names[id(prm)], prm)
        return out

    def sync_tied(self) -> None:
        """Sum each tied parameter's gradient over the ranks that hold it."""
        params = self.parameters()
        for name, ranks in self.tied:
            group = dist.new_group(list(ranks))
            if dist.get_rank() in ranks:
                g = params[name].grad
                assert g is not None
                dist.all_reduce(g, group=group)

    def step(self, inputs: tuple[Tensor, ...], target: Tensor) -> float | None:
        """One forward and backward of the batch; the loss where the last chunk runs."""
        for prm in self.parameters().values():
            prm.grad = None
        losses: list[Tensor] = []
        inputs, target = cast_batch(inputs, target, _dtype(self.plan.dtype), torch.device("cpu"))
        args = inputs if self.first else ()
        kwargs: dict[str, Any] = {}
        if self.last:
            kwargs = {"target": target, "losses": losses}
        self.schedule.step(*args, **kwargs)
        for prm in self.parameters().values():
            if prm.grad is not None:
                prm.grad.div_(self.plan.microbatches)
        self.sync_tied()
        return float(torch.stack(losses).mean()) if self.last else None


def _drop(merged: None, output: Tensor) -> None:
    """A last-stage output merged over micro-batches: dropped (see ``ChunkedRunner.build``)."""


def chunked_step(
    plan: Plan,
    spec: ModelSpec,
    inputs: tuple[Tensor, ...],
    target: Tensor,
    traced: TracedModel | None = None,
) -> tuple[float | None, dict[str, Tensor]]:
    """(loss or None, this rank's gradients by name) of one step of ``plan`` on the CPU
    (``traced`` as in :meth:`ChunkedRunner.build`)."""
    runner = ChunkedRunner.build(plan, spec, torch.device("cpu"), traced)
    loss = runner.step(inputs, target)
    return loss, {
        k: prm.grad.detach().clone()
        for k, prm in runner.parameters().items()
        if prm.grad is not None
    }


def launch_chunked(
    plan_path: str | os.PathLike[str],
    *,
    steps: int,
    warmup: int,
    optimizer: str,
    lr: float,
    seed: int,
    threads: int | None = None,
) -> int:
    """Run the plan's steps under torchrun on this machine's CPUs (gloo); the exit status."""
    from pipeplan.planner.io import load_plan

    p = load_plan(plan_path).cluster.n_stages
    per_rank = threads or max(1, (os.cpu_count() or 1) // p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={p}", "-m", "pipeplan.runtime.chunked", str(plan_path),
           f"--steps={steps}", f"--warmup={warmup}", f"--optimizer={optimizer}",
           f"--lr={lr}", f"--seed={seed}", f"--threads={per_rank}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(per_rank)}
    return subprocess.run(cmd, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> None:
    """One rank of ``pipeplan run`` on a multi-chunk plan (see the module docstring)."""
    from pipeplan.intake.model import load_model
    from pipeplan.planner.io import load_plan
    from pipeplan.planner.optim import make_optimizer

    ap = argparse.ArgumentParser(prog="pipeplan.runtime.chunked")
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    plan = load_plan(args.plan)
    torch.manual_seed(args.seed)
    spec = load_model(plan.model, dict(plan.model_kwargs))
    runner = ChunkedRunner.build(plan, spec, torch.device("cpu"))
    opt = make_optimizer(args.optimizer, list(runner.parameters().values()), args.lr)
    torch.manual_seed(args.seed + 1)
    inputs, target = spec.batch(plan.batch_size)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = runner.step(inputs, target)
        opt.step()
        dist.barrier()
        took = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(took)
        if loss is not None:
            print(f"step {step}: loss {loss:.6f}, {took * 1e3:.1f} ms", flush=True)
    if runner.last:
        print(
            f"{plan.schedule}, {plan.cluster.n_stages} ranks x {plan.stages_per_rank} chunks, "
            f"m = {plan.microbatches}: median step {statistics.median(times) * 1e3:.1f} ms "
            f"over {len(times)} steps, predicted {plan.step_time_s * 1e3:.1f} ms",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
