"""A pipeline stage that measures itself: the runner's ``PipelineStage``.

:class:`MeasuredStage` times each micro-batch's forward (F) and backward, whole (B) or split
into the inputs' gradient (I) and the weights' (W), into the rank's
:class:`~pipeplan.runtime.timing.StepTimer` (the run report's per-stage times and the Chrome
trace come from these spans), and calls a fault hook before each forward (the fault tests make
a stage fail there).  It lives apart from :mod:`pipeplan.runtime.timing` because importing
``torch.distributed.pipelining`` takes seconds, which a reader of run reports need not pay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining import PipelineStage

from pipeplan.runtime.timing import SpanKind, StepTimer

__all__ = ["FaultHook", "MeasuredStage"]

FaultHook = Callable[[int, int], None]
"""Called with (step, micro-batch) before each forward; tests use it to make a stage fail."""


class MeasuredStage(PipelineStage):
    """A PipelineStage that times each micro-batch's forward (F) and backward: the full one
    (B), or its split halves, the inputs' gradient (I: ``full_backward=False``) and the
    weights' (W: ``backward_weight_one_chunk``), each span named by its stage (chunk).

    A recomputing stage (``whole_backward``) runs its I as the full backward and its W as
    nothing: torch's W (``stage_backward_weight``) calls ``autograd.grad`` once per group of
    parameters, and each call unpacks the checkpoint, which remakes the stage's forward
    again (a GPT chunk of 3 blocks peaked at 68 MiB that way against 10 MiB without
    recomputing).  Its I span is then a B."""

    timer: StepTimer
    fault: FaultHook | None
    step_index: int
    whole_backward: bool = False

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.fault is not None:
            self.fault(self.step_index, fwd_chunk_id)
        with self.timer.span("forward", fwd_chunk_id, self.stage_index):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: Any = None,
        full_backward: bool = True,
        last_backward: Any = False,
    ) -> Any:
        full = full_backward or self.whole_backward
        kind: SpanKind = "backward" if full else "backward_input"
        with self.timer.span(kind, bwd_chunk_id, self.stage_index):
            return super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full, last_backward=last_backward
            )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.whole_backward:  # its I ran the whole backward
            return None
        with self.timer.span("backward_weight", bwd_chunk_id, self.stage_index):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
