"""A zoo Llama whose loss also reads its logits through numpy (``.numpy()`` is not defined for
a DTensor), for ``test_loss``: loss parallelism refuses it before the first step."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipeplan.intake.spec import ModelSpec
from pipeplan.models.zoo import llama


def numpy_loss_llama(**kwargs: Any) -> ModelSpec:
    spec = llama(heads=4, kv_heads=2, **kwargs)
    base = spec.loss

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        seen = torch.from_numpy(output.logits.detach().numpy())  # a metric, say
        return base(output, target) + 0 * seen.sum()

    return dataclasses.replace(spec, loss=loss)
