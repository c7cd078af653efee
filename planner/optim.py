"""The optimizers a plan can name, built one way for the profiler and the runtime.

The profiler times each optimizer's update on the model's parameters and the runtime trains
with the same construction, so the cost model's update time is the one the run pays.
``momentum`` is SGD with momentum 0.9.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from planner.errors import InvalidRequestError
from planner.types import OPTIMIZERS

__all__ = ["OPTIMIZERS", "make_optimizer"]


def make_optimizer(name: str, params: Sequence[Tensor], lr: float) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer ``name`` over ``params`` with learning rate ``lr``.

    >>> make_optimizer("momentum", [torch.zeros(2, requires_grad=True)], 0.1).defaults["momentum"]
    0.9
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise InvalidRequestError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
