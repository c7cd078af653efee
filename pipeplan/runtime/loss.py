"""The model's loss on the last stage's output, as a ``torch.distributed.pipelining`` schedule's
``loss_fn``.

The last stage sends the *tensor leaves* of the model's output
(:class:`~pipeplan.runtime.stages.StageModule`); :class:`StageLoss` puts the model's own output
back together from them (``rebuild_output``: nested tuples, dicts, a ``transformers``
``ModelOutput``) and calls the model's loss on it, timed as the step's ``loss`` span of its
micro-batch.  A loss that raises is reported as the user's code's error, naming the shapes and
types of the output and target it got (:func:`~pipeplan.runtime.stage_errors.describe_values`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from pipeplan.intake.usercode import user_error
from pipeplan.planner.errors import PipeplanError
from pipeplan.runtime.stage_errors import describe_values
from pipeplan.runtime.stages import StageModule
from pipeplan.runtime.timing import StepTimer

__all__ = ["StageLoss"]


class StageLoss:
    """``loss_fn(output, target)`` on the output ``output_module`` (the last stage's) rebuilds;
    each call is timed on ``timer``; errors name ``rank``."""

    def __init__(
        self,
        loss_fn: Callable[[Any, Tensor], Tensor],
        output_module: StageModule,
        timer: StepTimer,
        rank: int,
    ) -> None:
        self.loss_fn = loss_fn
        self.output_module = output_module
        self.timer = timer
        self.rank = rank
        self.calls = 0
        """Calls since the step began (the runner sets it to 0): the next one's micro-batch."""

    def __call__(self, output: Any, target: Tensor) -> Tensor:
        """The user's loss on the model's output, rebuilt from the last stage's tensors."""
        with self.timer.span("loss", self.calls):
            self.calls += 1
            rebuilt = self.output_module.rebuild_output(output)
            try:
                return self.loss_fn(rebuilt, target)
            except PipeplanError:
                raise
            except Exception as exc:  # name the values the loss got (only when it fails)
                what = (
                    f"the model's loss (stage {self.rank}) on output {describe_values(rebuilt)}"
                    f" and target {describe_values(target)}"
                )
                raise user_error(what, exc) from exc
