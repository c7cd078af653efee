"""A plan's stage for a user's own training loop.

:func:`split` builds this rank's stage of a plan exactly as ``pipeplan run`` does (the same
:class:`~pipeplan.runtime.engine.PipelineRunner`: cut at the plan's unit boundaries, only the
stage's tensors materialized when the model is built on ``meta``, weights initialised or read
from a checkpoint, the stage recomputed if the plan says so; batch-norm statistics per micro-batch) and hands back what a training loop
needs:

    module            the stage's ``nn.Module``: give its parameters to the optimizer
    stage             a :class:`torch.distributed.pipelining.PipelineStage` around it, with
                      static shapes: give it to any schedule (ScheduleGPipe, Schedule1F1B, ...)
    loss              the model's loss on the last stage's output, for the schedule's loss_fn
    sync_gradients()  after the schedule's step, before the optimizer's: sums tied parameters'
                      gradients over the stages holding them and averages over replicas

Rank ``r p + j`` runs stage ``j`` of replica ``r`` (``Plan.layout``); every rank of the world
calls :func:`split`, because building the tied-parameter and replica groups is collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from pipeplan.intake.model import ModelSpec
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Plan
from pipeplan.runtime.engine import PipelineRunner

__all__ = ["StageSplit", "split"]


@dataclass
class StageSplit:
    """This rank's stage; unpacks as ``module, stage = split(...)``."""

    module: nn.Module
    """The stage's module (its parameters are the ones this rank updates)."""
    stage: PipelineStage
    """The stage for a ``torch.distributed.pipelining`` schedule."""
    index: int
    """The stage's index j in the pipeline."""
    _runner: PipelineRunner = field(repr=False)

    def __iter__(self) -> Iterator[Any]:
        yield self.module
        yield self.stage

    def loss(self, output: Any, target: Tensor) -> Tensor:
        """The model's loss on the last stage's output (rebuilt into the model's own output
        structure from the tensors the stage sends): a schedule's ``loss_fn``."""
        return self._runner._loss(output, target)

    def sync_gradients(self) -> None:
        """Make this stage's gradients the whole model's: sum each tied parameter's over the
        stages that hold it, then average over the data-parallel replicas.  Call it on every
        rank after the schedule's step and before the optimizer's."""
        self._runner._sync_tied()
        if self._runner.replicas > 1:
            self._runner._average_replicas()

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The stage's parameters by their names in the unsplit model (a tied one once)."""
        return {self._runner.names[id(p)]: p for p in self._runner.params}


def split(
    plan: Plan,
    spec: ModelSpec,
    stage: int | None = None,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
    weights: str | None = None,
) -> StageSplit:
    """This rank's stage of ``plan`` for ``spec``'s model, as :class:`StageSplit`.

    Needs an initialised process group of ``plan.n_stages * plan.cluster.data_parallel``
    ranks (torchrun).  ``stage`` defaults to this rank's (``rank % p``) and, when given, must
    be it.  ``device`` defaults to ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU.
    A model built on ``meta`` gets only this stage's tensors, initialised with ``seed`` as the
    unsplit model would be, or read from the checkpoint ``weights`` (safetensors, a torch
    state dict, or a sharded folder with its index).
    """
    if plan.stages_per_rank > 1:
        raise InvalidRequestError(
            f"pipeplan.split hands each rank one stage; the plan's {plan.schedule} runs "
            f"{plan.stages_per_rank} chunks per rank: run it with pipeplan run, or plan "
            "--schedule gpipe or 1f1b for your own loop"
        )
    if not dist.is_initialized():
        raise InvalidRequestError(
            "pipeplan.split needs a process group: call torch.distributed.init_process_group() "
            f"first, under torchrun with {plan.n_stages * plan.cluster.data_parallel} ranks"
        )
    mine = dist.get_rank() % plan.n_stages
    if stage is not None and stage != mine:
        raise InvalidRequestError(
            f"rank {dist.get_rank()} runs stage {mine} of the plan's {plan.n_stages} (replica r's "
            f"stage j is rank r * {plan.n_stages} + j); pass stage={mine} or leave it out"
        )
    if device is None:
        if torch.cuda.is_available():
            import os

            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Batch-norm statistics update once per micro-batch (torchgpipe's default): deferring them
    # to the step's end is pipeplan run's own step logic, which a user's loop does not run.
    runner = PipelineRunner(
        plan, spec, device=device, seed=seed, weights=weights, lr=0.0, batch_norm="microbatch"
    )
    return StageSplit(module=runner.stage_module, stage=runner.stage, index=mine, _runner=runner)
