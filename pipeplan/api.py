"""pipeplan's Python face: profile a model, plan it, load files, split a plan for a loop.

    prof = pipeplan.profile("pipeplan.models.gpt:gpt", batch_size=32)
    plan = pipeplan.plan(prof, stages=4, memory="256MiB")
    pipeplan.save(plan, "plan.json")
    plan = pipeplan.load("plan.json")
    module, stage = pipeplan.split(plan)            # on every rank, under torchrun

The command line (:mod:`pipeplan.cli`) parses its options into these functions' arguments and
calls them; every check of a request is made here or in the packages below, once, so a Python
caller gets the same checks and messages as the command line (which name the options as it
spells them: ``--stages`` is ``stages=``).  Errors are the named exceptions of
:mod:`pipeplan.planner.errors` (all :class:`~pipeplan.planner.errors.PipeplanError`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from pipeplan.api_request import (
    PlanRequest,
    calibration,
    make_cluster,
    plan_request,
    target_allowed_cuts,
    target_families,
)
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import (
    load_any,
    write_json,
)
from pipeplan.planner.types import Cluster, Plan, Profile, RunReport

if TYPE_CHECKING:
    from pipeplan.intake.model import ModelSpec
    from pipeplan.runtime.stage_split import StageSplit

__all__ = [
    "PlanRequest",
    "calibration",
    "load",
    "make_cluster",
    "plan",
    "plan_request",
    "profile",
    "save",
    "split",
    "target_allowed_cuts",
    "target_families",
]

PathLike = str | os.PathLike[str]


def _model_name(model: str | Callable[..., Any]) -> str:
    """``package.module:callable`` for a model given as its name or as the callable itself."""
    if isinstance(model, str):
        return model
    module, qualname = getattr(model, "__module__", None), getattr(model, "__qualname__", "")
    if not callable(model) or module is None or module == "__main__" or "<" in qualname:
        raise InvalidRequestError(
            f"model {model!r} must be importable by name (every rank imports it): define it at "
            "the top level of a module, or pass 'package.module:callable'"
        )
    return f"{module}:{qualname}"


def profile(
    model: str | Callable[..., Any],
    batch_size: int,
    *,
    model_kwargs: Mapping[str, Any] | None = None,
    method: str = "auto",
    device: str = "cpu",
    microbatch_sizes: Sequence[int] | None = None,
    progress: bool = False,
    **options: Any,
) -> Profile:
    """Measure ``model``'s units at every micro-batch size (``pipeplan profile``).

    ``model`` is ``"package.module:callable"``, ``"hf:PATH/config.json"``, or the callable
    itself when it is importable by name: it returns a
    :class:`~pipeplan.intake.model.ModelSpec` or ``(module, make_batch, loss)``.  ``method``
    is ``whole`` (training passes of the real model), ``units`` (built on ``meta``, each
    distinct unit measured once) or ``auto``.  ``options`` are
    :func:`pipeplan.profiler.profile_model`'s (``granularity``, ``tracer``, ``dtype``,
    ``warmup``, ``repeats``, ``threads``, ``rounds``, ``max_stages``).
    """
    if batch_size <= 0:
        raise InvalidRequestError(f"--batch-size {batch_size} must be positive")
    from pipeplan.profiler import profile_model

    return profile_model(
        _model_name(model),
        batch_size=batch_size,
        model_kwargs=model_kwargs,
        microbatch_sizes=microbatch_sizes,
        device=device,
        method=method,
        progress=progress,
        **options,
    )


def plan(profile: Profile | PathLike, **request: Any) -> Plan:
    """The best plan for ``profile`` (a Profile or its file), as ``pipeplan plan``:
    ``plan_request(profile, **request).solve()``, every keyword :func:`plan_request`'s
    (``stages``, ``memory``, ``cluster``, ``devices``, ``solver``, ``target``, the
    ``PlanOptions`` fields, ...).  With ``devices`` the fastest depth is returned
    (:meth:`PlanRequest.frontier` gives them all).  Raises
    :class:`~pipeplan.planner.errors.InfeasiblePlanError` when nothing fits and
    :class:`~pipeplan.planner.errors.InvalidRequestError` for a bad request.
    """
    return plan_request(profile, **request).solve()


def load(path: PathLike) -> Profile | Plan | Cluster | RunReport:
    """Whichever pipeplan file ``path`` is (profile, plan, cluster or run report), validated;
    :class:`~pipeplan.planner.errors.FileFormatError` names what is wrong with a bad one."""
    return load_any(path)


def save(obj: BaseModel, path: PathLike) -> Path:
    """Write a Profile, Plan, Cluster or RunReport to ``path`` atomically (never half a file);
    returns the path."""
    write_json(path, obj)
    return Path(path)


def split(
    plan: Plan | PathLike,
    model: str | Callable[..., Any] | ModelSpec | None = None,
    stage: int | None = None,
    *,
    model_kwargs: Mapping[str, Any] | None = None,
    device: Any = None,
    seed: int = 0,
    weights: PathLike | None = None,
) -> StageSplit:
    """This rank's stage of ``plan`` for a training loop of one's own
    (:func:`pipeplan.runtime.stage_split.split`): unpacks as ``module, pipeline_stage``.

    ``model`` defaults to the plan's (its name and arguments), or is a name or an importable
    callable (``model_kwargs`` its arguments): either is built on ``meta`` and only this
    stage's tensors get memory, initialised with ``seed`` to the values the unsplit model gets
    for that seed, or read from the checkpoint ``weights``.  A built
    :class:`~pipeplan.intake.model.ModelSpec` is used as it is (real weights stay as they
    are).  Needs ``torch.distributed`` initialised with the plan's p x d ranks."""
    from pipeplan.intake.model import ModelSpec, load_model
    from pipeplan.runtime.stage_split import split as split_stage

    pl = plan if isinstance(plan, Plan) else _load_plan(plan)
    if isinstance(model, ModelSpec):
        spec = model
    else:
        name = pl.model if model is None else _model_name(model)
        kwargs = dict(pl.model_kwargs) if model is None else {}
        kwargs.update(model_kwargs or {})
        spec = load_model(name, kwargs, meta=True)
    return split_stage(
        pl, spec, stage, device=device, seed=seed, weights=None if weights is None else str(weights)
    )


def _load_plan(path: PathLike) -> Plan:
    from pipeplan.planner.io import load_plan

    return load_plan(path)
