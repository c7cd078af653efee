"""The model contract: how pipeplan gets a model, an example batch and a loss.

A model is named ``package.module:callable`` (like uvicorn's ``module:app``, and, like uvicorn,
the working directory is importable).  The callable is
called with the user's keyword arguments (``--model-arg depth=24``) and returns a
:class:`ModelSpec`, or a 3-tuple ``(module, make_batch, loss)`` with the same meaning:

- ``module``: the ``nn.Module`` to partition;
- ``make_batch(batch_size)``: returns ``(inputs, target)`` where ``inputs`` is a tensor or a
  tuple of tensors passed positionally to ``module`` and every tensor has the batch on dim 0;
- ``loss(output, target)``: a scalar, the *mean* over the batch (so that averaging the
  micro-batches' gradients gives the full batch's gradient).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.errors import ModelLoadError

__all__ = ["Batch", "ModelSpec", "as_tuple", "load_model", "parse_model_args"]

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a ``package.module:callable`` model returns."""

    module: nn.Module
    make_batch: Callable[[int], tuple[Any, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]

    def batch(self, batch_size: int) -> Batch:
        """``make_batch(batch_size)`` with the inputs normalised to a tuple, checked."""
        out = self.make_batch(batch_size)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ModelLoadError(
                f"make_batch({batch_size}) must return (inputs, target), got {type(out).__name__}"
            )
        inputs, target = as_tuple(out[0]), out[1]
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


def parse_model_args(pairs: list[str] | None) -> dict[str, str | int | float | bool]:
    """``['depth=24', 'name=gpt']`` -> ``{'depth': 24, 'name': 'gpt'}`` (ints, floats, bools)."""
    out: dict[str, str | int | float | bool] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ModelLoadError(f"model argument {pair!r} is not KEY=VALUE; write e.g. depth=24")
        value: str | int | float | bool = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def load_model(name: str, kwargs: Mapping[str, Any] | None = None) -> ModelSpec:
    """Import ``package.module:callable``, call it with ``kwargs`` and check what it returns."""
    mod_name, sep, attr = name.partition(":")
    if not sep or not mod_name or not attr:
        raise ModelLoadError(
            f"model {name!r} is not of the form package.module:callable; e.g. models.gpt:gpt"
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like uvicorn: models in the working directory import
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"model {name!r}: cannot import {mod_name!r} ({exc}); check the name and PYTHONPATH"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelLoadError(f"model {name!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelLoadError(f"model {name!r}: {attr!r} is a {type(obj).__name__}, not callable")
    try:
        out = obj(**dict(kwargs or {}))
    except TypeError as exc:
        raise ModelLoadError(
            f"model {name!r}: calling it failed ({exc}); check --model-arg"
        ) from None
    if isinstance(out, tuple) and len(out) == 3:
        out = ModelSpec(*out)
    if not isinstance(out, ModelSpec):
        raise ModelLoadError(
            f"model {name!r} returned {type(out).__name__}; it must return a "
            f"planner.model.ModelSpec or (module, make_batch, loss)"
        )
    if not isinstance(out.module, nn.Module):
        raise ModelLoadError(
            f"model {name!r}: its module is a {type(out.module).__name__}, not a torch.nn.Module"
        )
    if not callable(out.make_batch) or not callable(out.loss):
        raise ModelLoadError(f"model {name!r}: make_batch and loss must be callable")
    return out
