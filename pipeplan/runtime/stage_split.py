"""A plan's stage for a user's own training loop.

:func:`split` builds this rank's stage of a plan exactly as ``pipeplan run`` does (the same
:class:`~pipeplan.runtime.engine.PipelineRunner`: cut at the plan's unit boundaries, only the
stage's tensors materialized when the model is built on ``meta``, weights initialised or read
from a checkpoint, the stage recomputed if the plan says so; batch-norm statistics per micro-batch) and hands back what a training loop
needs:

    module            the stage's ``nn.Module`` (an ``nn.ModuleList`` of the rank's chunks when
                      the plan runs v > 1 per rank): give its parameters to the optimizer
    stage, stages     the :class:`torch.distributed.pipelining.PipelineStage` around it (around
                      each chunk), with static shapes
    schedule          the plan's own torch schedule (``Schedule1F1B``, ``ScheduleZBVZeroBubble``,
                      ...) over this rank's stages, with ``loss`` as its loss_fn: call its step
    loss              the model's loss on the last stage's output, for a schedule's loss_fn
    sync_gradients()  after the schedule's step, before the optimizer's: divides by m where
                      the schedule left it (v > 1), sums tied parameters' gradients over the
                      ranks holding them and averages over replicas, as ``pipeplan run`` does
                      (:mod:`pipeplan.runtime.gradsync`)

Rank ``r p + j`` runs position ``j`` (its stage, or its chunks ``stages_of_rank``) of replica
``r`` (``Plan.layout``); every rank of the world calls :func:`split`, because building the
tied-parameter and replica groups is collective.
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
from pipeplan.runtime.gradsync import average_replicas, divide_microbatches, sum_tied

__all__ = ["StageSplit", "split"]


@dataclass
class StageSplit:
    """This rank's stage (or chunks); unpacks as ``module, stage = split(...)``."""

    module: nn.Module
    """The stage's module, or an ``nn.ModuleList`` of the rank's chunks (its parameters are
    the ones this rank updates)."""
    stage: PipelineStage
    """The stage (the first chunk's) for a ``torch.distributed.pipelining`` schedule."""
    index: int
    """This rank's position j in the pipeline (its stage's index when v = 1)."""
    stages: tuple[PipelineStage, ...]
    """Every chunk's stage on this rank, in ``stages_of_rank`` order (one when v = 1)."""
    _runner: PipelineRunner = field(repr=False)

    @property
    def schedule(self) -> Any:
        """The plan's torch schedule class over this rank's stages, ``loss`` its loss_fn, the
        plan's m: ``schedule.step(*inputs)`` on the first rank, ``target=``/``losses=`` on the
        last (one object per split; build your own from ``stages`` if you prefer)."""
        return self._runner.schedule

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first chunk (it takes the inputs)."""
        return self._runner.is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last chunk (it takes the target and the losses)."""
        return self._runner.is_last

    def __iter__(self) -> Iterator[Any]:
        yield self.module
        yield self.stage

    def loss(self, output: Any, target: Tensor) -> Tensor:
        """The model's loss on the last stage's output (rebuilt into the model's own output
        structure from the tensors the stage sends): a schedule's ``loss_fn``."""
        return self._runner.loss(output, target)

    def sync_gradients(self) -> None:
        """Make this stage's gradients the whole model's: divide them by m where the schedule
        left them summed (v > 1), sum each tied parameter's over the stages that hold it, then
        average over the data-parallel replicas (:mod:`pipeplan.runtime.gradsync`).  Call it
        on every rank after the schedule's step and before the optimizer's."""
        runner = self._runner
        if runner.unscaled:
            divide_microbatches(runner.params, runner.plan.microbatches)
        sum_tied(runner.tied_groups)
        if runner.replicas > 1:
            average_replicas(runner.params, runner.dp_group, runner.replicas)

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

    Needs an initialised process group of ``plan.pipeline_ranks * plan.cluster.data_parallel
    * plan.cluster.tensor_parallel`` ranks (torchrun).  ``stage`` defaults to this rank's
    position (``rank // t % p``) and, when given, must be it.  ``device`` defaults to ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU.
    A model built on ``meta`` gets only this stage's tensors, initialised with ``seed`` as the
    unsplit model would be, or read from the checkpoint ``weights`` (safetensors, a torch
    state dict, or a sharded folder with its index).
    """
    t = plan.cluster.tensor_parallel
    if not dist.is_initialized():
        raise InvalidRequestError(
            "pipeplan.split needs a process group: call torch.distributed.init_process_group() "
            f"first, under torchrun with {plan.pipeline_ranks * plan.cluster.data_parallel * t} "
            "ranks"
        )
    p = plan.pipeline_ranks
    mine = dist.get_rank() // t % p
    if stage is not None and stage != mine:
        raise InvalidRequestError(
            f"rank {dist.get_rank()} runs position {mine} of the plan's {p} (replica r's "
            f"position j is ranks (r * {p} + j) * {t} + k); pass stage={mine} or leave it out"
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
    chunks = runner.chunk_modules
    return StageSplit(
        module=chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks),
        stage=runner.stage,
        index=mine,
        stages=tuple(runner.stages),
        _runner=runner,
    )
