"""The model's loss on the last stage's output, as a ``torch.distributed.pipelining`` schedule's
``loss_fn``.

The last stage sends the *tensor leaves* of the model's output
(:class:`~pipeplan.runtime.stages.StageModule`); :class:`StageLoss` puts the model's own output
back together from them (``rebuild_output``: nested tuples, dicts, a ``transformers``
``ModelOutput``) and calls the model's loss on it, timed as the step's ``loss`` span of its
micro-batch.  A loss that raises is reported as the user's code's error, naming the shapes and
types of the output and target it got (:func:`~pipeplan.runtime.stage_errors.describe_values`).

**Loss parallelism** (:class:`VocabSplit`, ``--loss-parallel``).  Where tensor parallelism
splits the output head over the vocabulary, the last stage can leave each rank its 1 / t of
the logits instead of all-gathering them: the loss reads them as a
:class:`~torch.distributed.tensor.DTensor` sharded on the vocabulary, and under torch's
``loss_parallel`` a cross-entropy on it computes the softmax's maximum, sum and the target's
logit with three all-reduces of one float per token.  The context must hold for the backward
too, so the runner steps the schedule inside :meth:`VocabSplit.context`.  Before the first
step :meth:`VocabSplit.check` runs the model's loss both ways on one micro-batch: a loss that
fails on split logits, or computes another value, is refused in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from pipeplan.intake.tp_layout import Style
from pipeplan.intake.usercode import user_error
from pipeplan.planner.errors import InvalidRequestError, PipeplanError
from pipeplan.runtime.stage_errors import describe_values
from pipeplan.runtime.stages import StageModule
from pipeplan.runtime.timing import StepTimer

__all__ = ["StageLoss", "VocabSplit", "vocab_size"]


def vocab_size(module: nn.Module, styles: dict[str, Style]) -> int:
    """The output features of ``module``'s head split over the vocabulary (``colwise_gather``);
    raises :class:`InvalidRequestError` where it has none."""
    for name, style in styles.items():
        if style == "colwise_gather":
            return int(getattr(module.get_submodule(name), "out_features", 0))
    raise InvalidRequestError(
        "--loss-parallel needs a head split over the vocabulary, and this model's layout has "
        "none (a tied or unsplit head); plan without --loss-parallel"
    )


@dataclass(frozen=True)
class VocabSplit:
    """The last stage's logits split over the vocabulary on ``mesh`` (the stage's tp ranks):
    its outputs at ``positions`` hold this rank's 1 / t of their last dimension (module
    docstring)."""

    mesh: Any
    vocab: int
    positions: tuple[int, ...]

    @classmethod
    def of(cls, mesh: Any, vocab: int, examples: Sequence[Tensor]) -> VocabSplit:
        """The split of a last stage whose whole outputs are ``examples``."""
        at = tuple(k for k, x in enumerate(examples) if x.dim() and x.shape[-1] == vocab)
        return cls(mesh, vocab, at)

    def local(self, outputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """``outputs`` (whole) as this rank holds them."""
        k, t = self.mesh.get_local_rank(), self.mesh.size()
        share = self.vocab // t
        return tuple(
            x.narrow(-1, k * share, share).contiguous() if i in self.positions else x
            for i, x in enumerate(outputs)
        )

    def wrap(self, outputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """This rank's outputs, the split ones as DTensors sharded on their last dimension."""
        from torch.distributed.tensor import DTensor, Shard

        return tuple(
            DTensor.from_local(x, self.mesh, [Shard(x.dim() - 1)], run_check=False)
            if i in self.positions
            else x
            for i, x in enumerate(outputs)
        )

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """torch's ``loss_parallel``, for the loss and its backward."""
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            yield

    def check(self, loss: StageLoss, outputs: Sequence[Tensor], target: Any) -> None:
        """Raise :class:`InvalidRequestError` unless the model's loss on this rank's
        ``outputs`` split equals its loss on them gathered whole (one micro-batch, no grad)."""
        from pipeplan.runtime.mesh import local

        split = self.wrap(outputs)
        whole = tuple(
            cast(Any, x).full_tensor() if i in self.positions else x for i, x in enumerate(split)
        )
        module = loss.output_module
        with torch.no_grad():
            want = loss.loss_fn(module.rebuild_output(whole), target)
            try:
                with self.context():
                    got = local(loss.loss_fn(module.rebuild_output(split), target))
            except Exception as exc:  # any failure on split logits is refused
                why = " ".join(str(exc).split())[:160]
                raise InvalidRequestError(
                    f"--loss-parallel: the model's loss does not run on logits split over the "
                    f"vocabulary ({type(exc).__name__}: {why}); plan without --loss-parallel"
                ) from exc
        if not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-6):
            raise InvalidRequestError(
                f"--loss-parallel: the model's loss on logits split over the vocabulary is "
                f"{float(got):.6g}, not {float(want):.6g} as on them whole; plan without "
                f"--loss-parallel"
            )


class StageLoss:
    """``loss_fn(output, target)`` on the output ``output_module`` (the last stage's) rebuilds;
    each call is timed on ``timer``; errors name ``rank``."""

    def __init__(
        self,
        loss_fn: Callable[[Any, Tensor], Tensor],
        output_module: StageModule,
        timer: StepTimer,
        rank: int,
        split: VocabSplit | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.split = split
        """Where the logits arrive split over the vocabulary (``--loss-parallel``)."""
        self.output_module = output_module
        self.timer = timer
        self.rank = rank
        self.calls = 0
        """Calls since the step began (the runner sets it to 0): the next one's micro-batch."""

    def __call__(self, output: Any, target: Tensor) -> Tensor:
        """The user's loss on the model's output, rebuilt from the last stage's tensors."""
        with self.timer.span("loss", self.calls):
            self.calls += 1
            if self.split is not None:
                output = self.split.wrap(output)
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
