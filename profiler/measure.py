"""Timing and byte-counting helpers of the profiler, and what it measures beside the units.

:func:`measure_checkpoint_call` times what one ``torch.utils.checkpoint`` call adds by itself,
:func:`measure_updates` one step of every optimizer over the model's parameters.  The units
themselves are timed inside whole passes (:mod:`profiler.sweep`).  Times are medians over
``repeats`` runs after ``warmup`` runs; spreads are interquartile ranges.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from planner.optim import OPTIMIZERS, make_optimizer
from planner.types import OptimizerName
from profiler.device import Clock

__all__: list[str] = []


def value_bytes(value: Any) -> int:
    """Bytes of every tensor in a (possibly nested) value; non-tensors count 0."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, Tensor))


def storage(t: Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. subclasses)
        return None


def storage_keys(tensors: Sequence[Tensor]) -> set[int]:
    """Data pointers of the tensors' storages (to exclude parameters from saved bytes)."""
    return {key[0] for t in tensors if (key := storage(t)) is not None}


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


def measure_updates(
    params: Sequence[Tensor], *, clock: Clock, warmup: int, repeats: int, seed: int = 0
) -> dict[OptimizerName, float]:
    """Median seconds of one step of every optimizer in :data:`planner.optim.OPTIMIZERS` over
    ``params``, with seeded gradients; the parameters are restored afterwards.

    The first steps allocate the optimizer's state, so at least one warm-up step always runs.
    """
    params = [t for t in params if t.requires_grad]
    if not params:
        return {}
    saved = [t.detach().clone() for t in params]
    g = torch.Generator().manual_seed(seed)
    for t in params:
        t.grad = torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)
    out: dict[OptimizerName, float] = {}
    try:
        for name in OPTIMIZERS:
            opt = make_optimizer(name, params, lr=1e-6)
            times = [clock.time(opt.step)[1] for _ in range(max(warmup, 1) + repeats)]
            out[name] = median_iqr(times[max(warmup, 1) :])[0]
    finally:
        with torch.no_grad():
            for t, v in zip(params, saved):
                t.copy_(v)
                t.grad = None
    return out
