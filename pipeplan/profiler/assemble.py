"""From measurements to a :class:`~pipeplan.planner.types.Profile`, shared by both profiling
methods (whole, :mod:`pipeplan.profiler.whole`; unit by unit, :mod:`pipeplan.profiler.units`):
the units and how they were grouped, the cut table, tied parameters, merged timing rounds, the
loss as a module, the source's checksum, and the Profile itself (:func:`assemble_profile`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from pipeplan.intake.graph import UnitSpec, cut_tensors, group_units
from pipeplan.intake.refine import node_costs, refine_units
from pipeplan.intake.trace import TracedModel
from pipeplan.intake.usercode import user_code
from pipeplan.planner.types import (
    Cut,
    CutTensor,
    Grouping,
    OptimizerName,
    Profile,
    SharedParam,
    Timing,
    Unit,
)
from pipeplan.profiler.device import device_info
from pipeplan.profiler.measure import value_bytes
from pipeplan.profiler.tp_annotate import annotate_traced
from pipeplan.profiler.unit_modules import UnitModule, split_units

__all__ = [
    "LossModule",
    "Recipe",
    "UnitSplit",
    "assemble_profile",
    "batch_dependent_layers",
    "cut_table",
    "merge_rounds",
    "per_sample",
    "shared_params",
    "source_sha256",
    "split_model",
]


@dataclass(frozen=True, slots=True)
class UnitSplit:
    """A traced model cut into units, once, for measuring and for the Profile."""

    traced: TracedModel
    specs: list[UnitSpec]
    pieces: list[UnitModule]
    """One callable per unit (:func:`pipeplan.profiler.unit_modules.split_units`)."""
    grouping: Grouping | None
    """How ``auto`` grouped the units (``None`` for other granularities)."""
    placeholders: list[str]
    """The graph's inputs, by node name."""


def split_model(
    traced: TracedModel, example: Sequence[Any], granularity: str, max_stages: int
) -> UnitSplit:
    """The units of ``granularity`` (``auto``: refined for ``max_stages`` on the cost estimate
    of ``example``, :mod:`pipeplan.intake.refine`), their callables and, for ``auto``, how they
    were grouped."""
    grouping: Grouping | None = None
    if granularity != "auto":
        specs = group_units(traced, granularity)
    else:
        base = len(group_units(traced, granularity))
        specs, opened = refine_units(traced, node_costs(traced, example), max_stages, granularity)
        grouping = Grouping(max_stages=max_stages, base_units=base, expanded=opened)
    placeholders = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    return UnitSplit(traced, specs, split_units(traced, specs), grouping, placeholders)


def per_sample(values: Mapping[str, Any], names: Sequence[str], b: int) -> int:
    """Bytes of the values ``names`` at micro-batch size ``b``, per sample (rounded up)."""
    return -(-sum(value_bytes(values[n]) for n in names) // b)


def cut_table(
    traced: TracedModel, units: list[UnitSpec], values: Mapping[str, Any], b: int
) -> tuple[Cut, ...]:
    """The cuts between ``units``: every tensor live across each, its bytes per sample from
    ``values`` (by node name) at micro-batch size ``b``."""
    cuts = []
    for k, names in enumerate(cut_tensors(traced, units)):
        tensors = tuple(
            CutTensor(node=n, bytes_per_sample=per_sample(values, [n], b)) for n in names
        )
        cuts.append(
            Cut(after=k, tensors=tensors, bytes_per_sample=sum(t.bytes_per_sample for t in tensors))
        )
    return tuple(cuts)


def source_sha256(model: str) -> str | None:
    """The SHA-256 of an ``hf:PATH`` model's config file (``None`` for a Python callable)."""
    if not model.startswith("hf:"):
        return None
    from pathlib import Path

    from pipeplan.intake.hf_source import file_sha256

    path = Path(model[3:])
    return file_sha256(path / "config.json" if path.is_dir() else path)


def batch_dependent_layers(module: torch.nn.Module) -> tuple[str, ...]:
    """Qualified names of the layers whose output depends on the whole batch (BatchNorm)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return tuple(name for name, m in module.named_modules() if isinstance(m, _BatchNorm))


class LossModule(torch.nn.Module):
    """The model's loss as a module of its output, the target fixed (it needs no gradient)."""

    def __init__(self, loss: Any, target: Any) -> None:
        super().__init__()
        self.loss, self.target = loss, target

    def forward(self, output: Any) -> Any:
        with user_code("the model's loss"):
            return self.loss(output, self.target)


def merge_rounds(rounds: list[Timing]) -> Timing:
    """One Timing from several rounds: median of the medians; spread = their interquartile range
    (or the single round's own spread)."""
    if len(rounds) == 1:
        return rounds[0]
    fwd = [t.forward_s for t in rounds]
    bwd = [t.backward_s for t in rounds]
    peaks = [t.peak_bytes for t in rounds if t.peak_bytes is not None]

    def iqr(xs: list[float]) -> float:
        q1, q3 = np.percentile(xs, [25, 75])
        return float(q3 - q1)

    rec = [t.recompute_backward_s for t in rounds if t.recompute_backward_s is not None]
    rec_f = [t.recompute_forward_s for t in rounds if t.recompute_forward_s is not None]
    return rounds[0].model_copy(
        update={
            "recompute_backward_s": float(np.median(rec)) if rec else None,
            "recompute_forward_s": float(np.median(rec_f)) if rec_f else None,
            "forward_s": float(np.median(fwd)),
            "backward_s": float(np.median(bwd)),
            "forward_spread_s": iqr(fwd),
            "backward_spread_s": iqr(bwd),
            "peak_bytes": max(peaks) if peaks else None,
        }
    )


def shared_params(gm: torch.nn.Module, used: Sequence[Sequence[str]]) -> tuple[SharedParam, ...]:
    """Parameters used by more than one unit (tied weights), with their bytes and users."""
    params = dict(gm.named_parameters())
    users: dict[str, list[int]] = {}
    for k, names in enumerate(used):
        for name in names:
            if name in params:
                users.setdefault(name, []).append(k)
    return tuple(
        SharedParam(
            name=name,
            bytes=params[name].numel() * params[name].element_size(),
            units=tuple(sorted(set(ks))),
        )
        for name, ks in sorted(users.items())
        if len(set(ks)) > 1
    )


@dataclass(frozen=True, slots=True)
class Recipe:
    """How a profile was asked for, as it records it: checked once by
    :func:`pipeplan.profiler.whole.profile_model` and passed to either method."""

    model: str
    model_kwargs: dict[str, str | int | float | bool]
    """The keyword arguments as the profile records them (JSON scalars)."""
    dtype: str
    batch_size: int
    sizes: tuple[int, ...]
    """The micro-batch sizes measured."""
    granularity: str
    warmup: int
    repeats: int
    rounds: int


def assemble_profile(
    recipe: Recipe,
    split: UnitSplit,
    *,
    module: torch.nn.Module,
    dev: torch.device,
    values: Mapping[str, Any],
    timings: Sequence[dict[int, Timing]],
    loss: dict[int, Timing],
    update_curve: dict[OptimizerName, tuple[tuple[int, float], ...]],
    call_s: tuple[float, float],
    method: Literal["whole", "units"],
    measured_as: Sequence[int] | None = None,
) -> Profile:
    """The Profile of ``recipe`` from what either method measured: ``timings[k]`` unit k's by
    micro-batch size (``measured_as[k]`` the unit measured for it, when not itself), ``values``
    the graph's values at the largest size (the inputs and the cuts' tensors by node name),
    ``module`` the model (for its batch-dependent layers and its tensor-parallel layout: the
    units are annotated by :func:`pipeplan.profiler.tp_annotate.annotate_traced`)."""
    r, traced = recipe, split.traced
    b_max = max(r.sizes)
    profile = Profile(
        model=r.model,
        model_kwargs=r.model_kwargs,
        tracer=traced.tracer,
        graph_fingerprint=traced.fingerprint,
        device=device_info(dev),
        torch_version=torch.__version__,
        dtype=r.dtype,
        batch_size=r.batch_size,
        microbatch_sizes=r.sizes,
        granularity=r.granularity,
        warmup=r.warmup,
        repeats=r.repeats,
        rounds=r.rounds,
        input_bytes_per_sample=per_sample(values, split.placeholders, b_max),
        units=tuple(
            Unit(
                index=k,
                name=p.spec.name,
                nodes=p.spec.nodes,
                params=p.params,
                param_bytes=p.param_bytes,
                largest_param_bytes=p.largest_param_bytes,
                timings=timings[k],
                measured_as=(
                    None if measured_as is None or measured_as[k] == k else measured_as[k]
                ),
            )
            for k, p in enumerate(split.pieces)
        ),
        cuts=cut_table(traced, split.specs, values, b_max),
        shared_params=shared_params(traced.gm, [p.params for p in split.pieces]),
        loss=loss,
        update_s={name: pts[-1][1] for name, pts in update_curve.items() if pts},
        update_curve=update_curve,
        checkpoint_call_s=call_s,
        model_sha256=source_sha256(r.model),
        batch_dependent_layers=batch_dependent_layers(module),
        grouping=split.grouping,
        method=method,
    )
    example = [values[n] for n in split.placeholders]
    return annotate_traced(profile, module, traced, example)
