"""The shape a model comes in: :class:`ModelSpec` (module, batches, loss) and the wrapper
:class:`NamedInputs` that lets a model taking named inputs run positionally.

The contract itself, and how a model is loaded, is :mod:`pipeplan.intake.model`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeplan.intake.usercode import user_code
from pipeplan.planner.errors import ModelLoadError

__all__ = [
    "Batch",
    "ModelSpec",
    "NamedInputs",
    "as_tuple",
    "cast_batch",
    "cast_floating",
    "is_transformers_model",
]


Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def cast_floating(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` (in place, and returned) with its floating-point parameters and buffers in
    ``dtype``; complex and integer ones stay as they are.

    ``module.to(dtype=torch.float32)`` casts complex tensors too and drops their imaginary
    part (torchtitan's Llama keeps its RoPE table ``freqs_cis`` in complex64), which would
    make pipeplan profile and train another model than the user's.
    """
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a ``package.module:callable`` model returns."""

    module: nn.Module
    make_batch: Callable[[int], tuple[Any, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    init_weights: Callable[[nn.Module], None] | None = None
    """Initialises one module's own parameters and buffers in place, for a model built on
    ``meta`` (:mod:`pipeplan.intake.meta`); ``None``: ``reset_parameters`` or ``transformers``'."""

    def batch(self, batch_size: int) -> Batch:
        """``make_batch(batch_size)`` with the inputs normalised to a tuple, checked.

        Named inputs come back in the order of :class:`NamedInputs` ``names`` when the module
        is one (what :func:`load_model` makes of a model that takes a dict).
        """
        with user_code(f"the model's make_batch({batch_size})"):
            out = self.make_batch(batch_size)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ModelLoadError(
                f"make_batch({batch_size}) must return (inputs, target), got {type(out).__name__}"
            )
        inputs, target = out
        if isinstance(inputs, Mapping):
            names = self.module.names if isinstance(self.module, NamedInputs) else None
            if names is None or set(inputs) != set(names):
                raise ModelLoadError(
                    f"make_batch({batch_size}) returned inputs named {sorted(inputs)}, but the "
                    f"model takes {sorted(names or [])}; return the same names for every size"
                )
            inputs = tuple(inputs[n] for n in names)
        inputs = as_tuple(inputs)
        for t in (*inputs, target):
            if not isinstance(t, torch.Tensor):
                raise ModelLoadError(
                    f"make_batch({batch_size}) returned a {type(t).__name__}; "
                    f"inputs and target must be tensors"
                )
            if t.dim() == 0 or t.shape[0] != batch_size:
                raise ModelLoadError(
                    f"make_batch({batch_size}) returned a tensor of shape {tuple(t.shape)}; "
                    f"dim 0 must be the batch ({batch_size})"
                )
        return inputs, target


def as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class NamedInputs(nn.Module):
    """``forward(*tensors)`` calls ``model(**dict(zip(names, tensors)), **fixed)``.

    ``names`` is ``None`` for positional inputs.  ``fixed`` holds the keyword switches a
    ``transformers`` model needs for training in a pipeline: ``use_cache=False`` (the KV cache
    would be an output no stage can send) and ``return_dict=True``, each only where ``forward``
    takes it.  The model is the attribute ``model``, so parameter names gain a ``model.``
    prefix; unit names drop it (:mod:`pipeplan.intake.graph`).
    """

    def __init__(
        self, model: nn.Module, names: Sequence[str] | None, fixed: Mapping[str, Any]
    ) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names) if names is not None else None
        self.fixed = dict(fixed)

    def forward(self, *inputs: Any) -> Any:
        if self.names is None:
            return self.model(*inputs, **self.fixed)
        return self.model(**dict(zip(self.names, inputs)), **self.fixed)


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (without importing it)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def cast_batch(
    inputs: tuple[torch.Tensor, ...], target: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Move a batch to ``device``; floating-point tensors take the plan's ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return tuple(cast(t) for t in inputs), cast(target)
