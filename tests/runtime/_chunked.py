"""One forward and backward of a plan on this rank, its gradients by the model's names.

Every plan, of one stage per rank (GPipe, 1F1B) or of v chunks per rank (interleaved,
looped, zero-bubble, V), runs on :class:`pipeplan.runtime.engine.PipelineRunner`, which
``pipeplan run`` drives (:mod:`pipeplan.runtime.worker`).  :func:`chunked_step` is the
equivalence tests' view of it: every rank builds the model as the unsplit one (same seed),
runs one step of the batch and hands back the loss (where the last stage runs) and this
rank's gradients, which the tests compare with the unsplit model's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeplan.intake.model import ModelSpec
from pipeplan.intake.trace import TracedModel
from pipeplan.planner.types import Plan
from pipeplan.runtime.engine import PipelineRunner

__all__ = ["chunked_step"]


def chunked_step(
    plan: Plan,
    spec: ModelSpec,
    inputs: tuple[Tensor, ...],
    target: Tensor,
    traced: TracedModel | None = None,
) -> tuple[float | None, dict[str, Tensor]]:
    """(loss or None, this rank's gradients by name) of one step of ``plan`` on the CPU,
    in the default process group; ``traced``: ``spec.module`` already traced (in the plan's
    dtype), as :class:`~pipeplan.runtime.engine.PipelineRunner` takes it."""
    runner = PipelineRunner(plan, spec, device=torch.device("cpu"), traced=traced)
    loss = runner.forward_backward(inputs, target)
    return loss, {
        k: prm.grad.detach().clone()
        for k, prm in runner.named_parameters().items()
        if prm.grad is not None
    }
