"""Timing and byte-counting helpers of the profiler, and what it measures beside the units.

:func:`measure_checkpoint_call` times what one ``torch.utils.checkpoint`` call adds by itself,
:func:`measure_update_curve` one step of every optimizer over growing prefixes of the
model's parameters.  The units themselves are timed inside whole passes
(:mod:`pipeplan.profiler.sweep`).  Times are medians over ``repeats`` runs after ``warmup`` runs;
spreads are interquartile ranges.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from pipeplan.planner.optim import OPTIMIZERS, make_optimizer
from pipeplan.planner.types import OptimizerName
from pipeplan.profiler.device import Clock

__all__: list[str] = []


def value_bytes(value: Any) -> int:
    """Bytes of every tensor in a (possibly nested) value; non-tensors count 0."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, Tensor))


def storage(t: Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of ``t``'s storage; a DTensor's is its local shard's."""
    local = getattr(t, "_local_tensor", None)
    t = local if isinstance(local, Tensor) else t
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. subclasses)
        return None


def storage_keys(tensors: Sequence[Tensor]) -> set[int]:
    """Data pointers of the tensors' storages (to exclude parameters from saved bytes)."""
    return {key[0] for t in tensors if (key := storage(t)) is not None}


@contextlib.contextmanager
def saved_storages(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Inside the block, the distinct storages autograd saves for backward (data pointer ->
    bytes), except those in ``exclude`` (the parameters')."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        key = storage(t)
        if key is not None and key[0] not in exclude:
            seen[key[0]] = max(seen.get(key[0], 0), key[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def differentiable(outputs: Any) -> list[Tensor]:
    return [t for t in tree_leaves(outputs) if isinstance(t, Tensor) and t.requires_grad]


def _double(x: Tensor) -> Tensor:
    return x * 2.0


def measure_checkpoint_call(
    device: torch.device, *, clock: Clock, warmup: int, repeats: int
) -> tuple[float, float]:
    """(forward, backward) seconds one non-reentrant ``checkpoint`` call adds by itself.

    Medians of a checkpointed and a plain run of ``x * 2`` (which saves no tensor) on a
    one-element leaf, forward and backward separately; differences clamped at 0.
    """
    x = torch.ones(1, device=device, requires_grad=True)
    grad = torch.ones(1, device=device)
    plain: list[tuple[float, float]] = []
    ckpt: list[tuple[float, float]] = []
    for i in range(max(warmup, 1) + repeats):
        out, f = clock.time(lambda: _double(x))
        _, b = clock.time(functools.partial(torch.autograd.backward, out, grad))
        out, cf = clock.time(lambda: checkpoint(_double, x, use_reentrant=False))
        _, cb = clock.time(functools.partial(torch.autograd.backward, out, grad))
        if i >= max(warmup, 1):
            plain.append((f, b))
            ckpt.append((cf, cb))
    x.grad = None
    fwd = median_iqr([c[0] for c in ckpt])[0] - median_iqr([p[0] for p in plain])[0]
    bwd = median_iqr([c[1] for c in ckpt])[0] - median_iqr([p[1] for p in plain])[0]
    return max(fwd, 0.0), max(bwd, 0.0)


def median_iqr(samples: list[float]) -> tuple[float, float]:
    if not samples:
        return 0.0, 0.0
    q1, med, q3 = np.percentile(samples, [25, 50, 75])
    return float(med), float(q3 - q1)


#: Bytes written between timed optimizer steps on a CPU, so that each step starts with the
#: cache cold, as a step after a backward does (twice this host's 32 MiB L3).
FLUSH_BYTES = 64 << 20


def measure_update_curve(
    units: Sequence[Sequence[Tensor]],
    *,
    clock: Clock,
    warmup: int,
    repeats: int,
    points: int = 6,
    seed: int = 0,
    restore: bool = True,
) -> dict[OptimizerName, tuple[tuple[int, float], ...]]:
    """(bytes, median seconds) of one step of every optimizer in :data:`pipeplan.planner.optim.OPTIMIZERS`
    over the parameters of units 0..k, for the ``points`` prefixes whose bytes come nearest
    above 1/points, 2/points, .., all of the model's (``Profile.update_curve``).

    Gradients are seeded; on a CPU, :data:`FLUSH_BYTES` are written before every timed step.
    The first steps allocate the optimizer's state, so at least one warm-up step always runs.
    The parameters are restored afterwards (with ``restore``, from a copy); their gradients
    are cleared.
    """
    seen: set[int] = set()
    prefixes: list[list[Tensor]] = []
    for tensors in units:
        new = [t for t in tensors if t.requires_grad and id(t) not in seen]
        seen.update(id(t) for t in new)
        prefixes.append([*(prefixes[-1] if prefixes else []), *new])
    sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in prefixes]
    if not sizes or sizes[-1] == 0:
        return {}
    chosen = curve_points(sizes, points)
    params = prefixes[-1]
    saved = [t.detach().clone() for t in params] if restore else []
    g = torch.Generator().manual_seed(seed)
    for t in params:
        t.grad = torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)
    cpu = params[0].device.type == "cpu"
    junk = torch.zeros(FLUSH_BYTES // 4) if cpu else None
    out: dict[OptimizerName, list[tuple[int, float]]] = {name: [] for name in OPTIMIZERS}
    try:
        for k in chosen:
            for name in OPTIMIZERS:
                opt = make_optimizer(name, prefixes[k], lr=1e-6)
                times = []
                for _ in range(max(warmup, 1) + repeats):
                    if junk is not None:
                        junk.add_(1.0)
                    times.append(clock.time(opt.step)[1])
                out[name].append((sizes[k], median_iqr(times[max(warmup, 1) :])[0]))
                del opt
    finally:
        with torch.no_grad():
            for t, v in zip(params, saved):
                t.copy_(v)
            for t in params:
                t.grad = None
    return {name: tuple(pts) for name, pts in out.items()}


def curve_points(sizes: Sequence[int], points: int) -> list[int]:
    """Indices of the ascending prefix ``sizes`` nearest above 1/points, 2/points, .., all of
    the last: the prefixes an update curve is measured or summed at.

    >>> curve_points([10, 20, 30, 40], 2)
    [1, 3]
    """
    return sorted({
        int(np.searchsorted(sizes, sizes[-1] * (i + 1) / points - 1e-9, side="left"))
        for i in range(points)
    })  # fmt: skip


def summed_update_curve(
    unit_bytes: Sequence[int],
    unit_seconds: Sequence[dict[OptimizerName, float]],
    step_s: dict[OptimizerName, float] | None = None,
    points: int = 6,
) -> dict[OptimizerName, tuple[tuple[int, float], ...]]:
    """An update curve (as :func:`measure_update_curve`) from per-unit steps measured alone, at
    the same growing prefixes of units 0..k: one step's fixed cost ``step_s`` (a step over one
    element) plus each unit's step net of it, summed (a stage steps once, not once per unit).

    >>> summed_update_curve([4, 4], [{"sgd": 1.5}, {"sgd": 2.5}], {"sgd": 0.5}, points=2)
    {'sgd': ((4, 1.5), (8, 3.5))}
    """
    sizes = list(np.cumsum(unit_bytes))
    if not sizes or sizes[-1] == 0:
        return {}
    fixed = step_s or {}
    names = sorted({name for s in unit_seconds for name in s})
    out: dict[OptimizerName, tuple[tuple[int, float], ...]] = {}
    for name in names:
        c = fixed.get(name, 0.0)
        net = np.cumsum([max(s.get(name, 0.0) - c, 0.0) for s in unit_seconds])
        out[name] = tuple((int(sizes[k]), c + float(net[k])) for k in curve_points(sizes, points))
    return out


def measure_updates(
    params: Sequence[Tensor],
    *,
    clock: Clock,
    warmup: int,
    repeats: int,
    seed: int = 0,
    restore: bool = True,
) -> dict[OptimizerName, float]:
    """Median seconds of one step of every optimizer over ``params`` (cold cache on a CPU):
    the last point of :func:`measure_update_curve` with all of them as one unit."""
    curve = measure_update_curve(
        [params], clock=clock, warmup=warmup, repeats=repeats, points=1, seed=seed, restore=restore
    )
    return {name: pts[-1][1] for name, pts in curve.items() if pts}
