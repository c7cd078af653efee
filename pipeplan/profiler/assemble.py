"""From measurements to a :class:`~pipeplan.planner.types.Profile`'s parts, shared by both
profiling methods (whole, :mod:`pipeplan.profiler.whole`; unit by unit,
:mod:`pipeplan.profiler.units`): the units and how they were grouped, the cut table, tied
parameters, merged timing rounds, the loss as a module, and the source's checksum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipeplan.intake.graph import UnitSpec, cut_tensors, group_units
from pipeplan.intake.refine import node_costs, refine_units
from pipeplan.intake.trace import TracedModel
from pipeplan.intake.usercode import user_code
from pipeplan.planner.types import Cut, CutTensor, Grouping, SharedParam, Timing
from pipeplan.profiler.measure import value_bytes

__all__ = [
    "LossModule",
    "batch_dependent_layers",
    "cut_table",
    "group",
    "merge_rounds",
    "per_sample",
    "shared_params",
    "source_sha256",
]


def group(
    traced: TracedModel, example: Sequence[Any], granularity: str, max_stages: int
) -> tuple[list[UnitSpec], Grouping | None]:
    """The units of ``granularity`` (``auto``: refined for ``max_stages`` on the cost estimate
    of ``example``, :mod:`pipeplan.intake.refine`) and, for ``auto``, how they were grouped."""
    if granularity != "auto":
        return group_units(traced, granularity), None
    base = len(group_units(traced, granularity))
    units, opened = refine_units(traced, node_costs(traced, example), max_stages, granularity)
    return units, Grouping(max_stages=max_stages, base_units=base, expanded=opened)


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
