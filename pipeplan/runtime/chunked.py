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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, schedules

from pipeplan.intake.graph import group_units
from pipeplan.intake.model import ModelSpec
from pipeplan.intake.trace import trace_model
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.schedules import FAMILIES, stages_of_rank
from pipeplan.planner.types import Plan
from pipeplan.runtime.engine import Recompute
from pipeplan.runtime.stages import build_stages, parameter_names, tied_parameters

__all__ = ["ChunkedRunner", "chunked_step"]


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
    def build(cls, plan: Plan, spec: ModelSpec, device: torch.device) -> ChunkedRunner:
        p, v = plan.cluster.n_stages, plan.stages_per_rank
        if plan.cluster.data_parallel != 1:
            raise InvalidRequestError("multi-chunk plans run one pipeline; plan with --stages")
        if dist.get_world_size() != p:
            raise InvalidRequestError(
                f"plan {plan.schedule} runs on {p} ranks; the world size is "
                f"{dist.get_world_size()} (--nproc-per-node {p})"
            )
        rank = dist.get_rank()
        module = spec.module
        inputs, _ = spec.batch(plan.microbatch_size)
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
        sched = cls_(
            stages[0] if v == 1 else stages, plan.microbatches, loss_fn=loss, scale_grads=False
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


def chunked_step(
    plan: Plan, spec: ModelSpec, inputs: tuple[Tensor, ...], target: Tensor
) -> tuple[float | None, dict[str, Tensor]]:
    """(loss or None, this rank's gradients by name) of one step of ``plan`` on the CPU."""
    runner = ChunkedRunner.build(plan, spec, torch.device("cpu"))
    loss = runner.step(inputs, target)
    return loss, {
        k: prm.grad.detach().clone()
        for k, prm in runner.parameters().items()
        if prm.grad is not None
    }
