"""The model contract: how pipeplan gets a model, an example batch and a loss.

A model is named ``package.module:callable`` (like uvicorn's ``module:app``, and, like uvicorn,
the working directory is importable).  The callable is
called with the user's keyword arguments (``--model-arg depth=24``) and returns a
:class:`ModelSpec`, or a 3-tuple ``(module, make_batch, loss)`` with the same meaning:

- ``module``: the ``nn.Module`` to partition;
- ``make_batch(batch_size)``: returns ``(inputs, target)`` where ``inputs`` is a tensor, a
  tuple of tensors passed positionally to ``module``, or a dict of tensors passed by name
  (``{"input_ids": ..., "decoder_input_ids": ...}``), and every tensor has the batch on dim 0;
- ``loss(output, target)``: a scalar, the *mean* over the batch (so that averaging the
  micro-batches' gradients gives the full batch's gradient).  ``output`` is exactly what
  ``module`` returns: a tensor, a tuple, a dict, or a ``transformers`` ``ModelOutput``.

A ``transformers`` ``PreTrainedModel`` is taken as it is: pipeplan turns its KV cache off
(``use_cache=False``) and asks for a ``ModelOutput`` (``return_dict=True``).  The callable may
even return the bare ``PreTrainedModel``; the batches and the loss then come from its config
(:mod:`pipeplan.intake.hf_source`, as for ``hf:PATH/config.json``; the model argument ``seq_len``,
``--seq-len``, sets the batches' length and reaches the callable only if it takes it).  The
loss receives exactly what ``forward`` returns (a ``ModelOutput``).  Named inputs and these
switches are applied by :class:`NamedInputs`, a wrapper whose ``forward`` takes the inputs
positionally (what the tracers and the pipeline stages pass), so the user writes no wrapper.

Every call into the user's code (the callable, ``make_batch``, the loss, ``forward``) that
raises is reported as one :class:`~pipeplan.planner.errors.UserCodeError` line naming the user's file
and line (:mod:`pipeplan.intake.usercode`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from pipeplan.intake.spec import Batch, ModelSpec, NamedInputs, as_tuple, is_transformers_model
from pipeplan.intake.usercode import user_code
from pipeplan.planner.errors import ModelLoadError

__all__ = [
    "Batch",
    "ModelSpec",
    "NamedInputs",
    "as_tuple",
    "load_model",
    "model_module",
    "parse_model_args",
]


def _switches(model: nn.Module) -> dict[str, Any]:
    """``use_cache=False`` and ``return_dict=True`` where ``model.forward`` takes them."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    fixed: dict[str, Any] = {}
    for key, value in (("use_cache", False), ("return_dict", True)):
        if key in params or (takes_any and is_transformers_model(model)):
            fixed[key] = value
    return fixed


def adapt(spec: ModelSpec) -> ModelSpec:
    """Wrap ``spec.module`` in :class:`NamedInputs` when it takes named inputs or is a
    ``transformers`` model; otherwise return ``spec`` unchanged."""
    module = spec.module
    hf = is_transformers_model(module)
    config: Any = getattr(module, "config", None)
    if hf and getattr(config, "use_cache", None):
        config.use_cache = False
    with user_code("the model's make_batch(1)"):
        probe = spec.make_batch(1)
    named = isinstance(probe, tuple) and len(probe) == 2 and isinstance(probe[0], Mapping)
    if not (named or hf):
        return spec
    names = [str(k) for k in probe[0]] if named else None
    return ModelSpec(
        NamedInputs(module, names, _switches(module) if hf else {}),
        spec.make_batch,
        spec.loss,
        spec.init_weights,
    )


def _takes(fn: Callable[..., Any], key: str) -> bool:
    """Whether ``fn`` accepts the keyword ``key`` (``True`` when it cannot be told)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return key in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


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


def model_module(name: str) -> str:
    """The module that building model ``name`` imports first: ``transformers`` for an
    ``hf:`` config, else the module of ``package.module:callable``."""
    return "transformers" if name.startswith("hf:") else name.partition(":")[0]


def load_model(
    name: str, kwargs: Mapping[str, Any] | None = None, *, meta: bool = False
) -> ModelSpec:
    """Import ``package.module:callable``, call it with ``kwargs`` and check what it returns.

    ``hf:PATH/config.json`` builds a ``transformers`` model from a local config instead
    (:func:`pipeplan.intake.hf_source.load_config`).  With ``meta`` the model is built with its
    parameters on ``meta`` (:func:`pipeplan.intake.meta.empty_parameters`): no memory, no values.
    """
    if meta:
        from pipeplan.intake.meta import empty_parameters

        with empty_parameters():
            return load_model(name, kwargs)
    if name.startswith("hf:"):
        from pipeplan.intake.hf_source import load_config

        return adapt(load_config(name[3:], dict(kwargs or {})))
    mod_name, sep, attr = name.partition(":")
    if not sep or not mod_name or not attr:
        raise ModelLoadError(
            f"model {name!r} is not of the form package.module:callable; e.g. pipeplan.models.gpt:gpt"
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
    call = dict(kwargs or {})
    # --seq-len is for the batches pipeplan makes for a bare transformers model: a callable
    # that takes no seq_len does not get it (and must return such a model, checked below).
    held = call.pop("seq_len", None) if "seq_len" in call and not _takes(obj, "seq_len") else None
    try:
        inspect.signature(obj).bind(**call)
    except TypeError as exc:
        raise ModelLoadError(
            f"model {name!r}: calling it failed ({exc}); check --model-arg"
        ) from None
    except ValueError:  # no signature to check (a builtin): let the call tell
        pass
    with user_code(f"the model callable {name}"):
        out = obj(**call)
    if isinstance(out, nn.Module) and is_transformers_model(out):
        from pipeplan.intake.hf_source import default_spec

        out = default_spec(out, seq_len=dict(kwargs or {}).get("seq_len"))
    elif held is not None:
        raise ModelLoadError(
            f"model {name!r} takes no seq_len argument; --seq-len is for hf: configs, bare "
            f"transformers models and callables with a seq_len parameter"
        )
    if isinstance(out, tuple) and len(out) == 3:
        out = ModelSpec(*out)
    if not isinstance(out, ModelSpec):
        raise ModelLoadError(
            f"model {name!r} returned {type(out).__name__}; it must return a "
            f"pipeplan.intake.model.ModelSpec or (module, make_batch, loss)"
        )
    if not isinstance(out.module, nn.Module):
        raise ModelLoadError(
            f"model {name!r}: its module is a {type(out.module).__name__}, not a torch.nn.Module"
        )
    if not callable(out.make_batch) or not callable(out.loss):
        raise ModelLoadError(f"model {name!r}: make_batch and loss must be callable")
    return adapt(out)
