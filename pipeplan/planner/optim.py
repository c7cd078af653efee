"""The optimizers a plan can name, built one way for the profiler and the runtime.

The profiler times each optimizer's update on the model's parameters and the runtime trains
with the same construction, so the cost model's update time is the one the run pays.
``momentum`` is SGD with momentum 0.9.

Adam is the *fused* implementation (``fused=True``; torch >= 2.4 on CPU and CUDA), as
torchtitan's default: one kernel over all tensors, no temporaries.  The others each leave a
temporary in the step's peak memory: the for-loop implementation (torch's CPU default) two of
the largest parameter's size (``sqrt(v) / c``), the ``foreach`` one (its CUDA default) one of
*all* the parameters' size (``_foreach_sqrt``); fused Adam keeps the step's peak at the
parameters, their gradients and the two states the cost model charges
(:func:`pipeplan.planner.costmodel.stage_memory`).  It is also about 18x faster on this CPU (two
tensors of 8 MiB and 4 MiB: 1.4 ms against 25 ms).  Where fused kernels do not apply (a
parameter on another device), the step falls back to torch's default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import OPTIMIZERS

__all__ = ["OPTIMIZERS", "make_optimizer"]


def make_optimizer(name: str, params: Sequence[Tensor], lr: float) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer ``name`` over ``params`` with learning rate ``lr``.

    >>> make_optimizer("momentum", [torch.zeros(2, requires_grad=True)], 0.1).defaults["momentum"]
    0.9
    >>> make_optimizer("adam", [], 0.1).param_groups[0]["params"]
    []
    """
    # One group per kind of tensor, possibly empty: a stage without parameters (a lone
    # activation) still steps (torch refuses a bare empty list: "optimizer got an empty
    # parameter list"); a tensor-parallel stage's DTensor parameters apart from its plain ones,
    # since the fused and foreach kernels take one kind per call.
    kinds = dict.fromkeys(type(p) for p in params)
    groups = [{"params": [p for p in params if type(p) is k]} for k in kinds] or [{"params": []}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, fused=_fusable(params))
    raise InvalidRequestError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")


def _fusable(params: Sequence[Tensor]) -> bool | None:
    """``True`` where torch's fused Adam runs: floating-point tensors on CPU or CUDA."""
    ok = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return True if ok and params else None
