"""Measure one unit at one micro-batch size: forward and backward seconds, saved and output bytes.

The unit runs alone, as a pipeline stage would: its floating-point inputs are fresh leaves that
require grad, its backward is ``torch.autograd.backward`` from its outputs with random output
gradients (drawn once, outside the timed region).  Bytes saved for backward are counted with
``torch.autograd.graph.saved_tensors_hooks`` during one extra forward: each storage once,
parameters and buffers excluded, the unit's own saved inputs included.  Each repeat also times the
backward of the unit under non-reentrant ``torch.utils.checkpoint`` (the forward recomputed, as
a checkpointed stage runs it).  A loop of forwards only times the unit's checkpointed forward
(the hooks pack the saved tensors away) against its plain one; the difference, added to the
plain forward, is the checkpointed forward.  :func:`measure_checkpoint_call` times what one
checkpoint call adds by itself.  Times are medians over
``repeats`` runs after ``warmup`` runs (the counting forward is the first); the spread is their interquartile range.
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

from planner.optim import OPTIMIZERS, make_optimizer
from planner.types import OptimizerName, Timing
from profiler.device import Clock

__all__: list[str] = []


def value_bytes(value: Any) -> int:
    """Bytes of every tensor in a (possibly nested) value; non-tensors count 0."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, Tensor))


def _storage(t: Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. subclasses)
        return None


def storage_keys(tensors: Sequence[Tensor]) -> set[int]:
    """Data pointers of the tensors' storages (to exclude parameters from saved bytes)."""
    return {key[0] for t in tensors if (key := _storage(t)) is not None}


def _leaves(inputs: Sequence[Any], frozen: frozenset[int] = frozenset()) -> tuple[Any, ...]:
    """Detached copies of the inputs; floating-point tensors become leaves that require grad,
    except the positions in ``frozen`` (the model's own inputs: no stage computes their
    gradient, so timing one would overcharge the backward)."""
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, Tensor):
            x = x.detach()
            if (x.is_floating_point() or x.is_complex()) and i not in frozen:
                x.requires_grad_(True)
        out.append(x)
    return tuple(out)


def _differentiable(outputs: Any) -> list[Tensor]:
    return [t for t in tree_leaves(outputs) if isinstance(t, Tensor) and t.requires_grad]


def saved_bytes(
    module: torch.nn.Module,
    inputs: Sequence[Any],
    exclude: set[int],
    frozen: frozenset[int] = frozenset(),
) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves in one forward (except ``exclude``'s),
    and that forward's output."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage(t)
        if key is not None and key[0] not in exclude:
            seen[key[0]] = max(seen.get(key[0], 0), key[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*_leaves(inputs, frozen))
    return sum(seen.values()), out


def _step(
    module: torch.nn.Module,
    inputs: Sequence[Any],
    grads: list[Tensor],
    clock: Clock,
    frozen: frozenset[int] = frozenset(),
) -> tuple[float, float]:
    """One timed forward and backward: (forward seconds, backward seconds)."""
    out, f = clock.time(lambda: module(*_leaves(inputs, frozen)))
    diff = _differentiable(out)
    if not diff:
        return f, 0.0
    _, b = clock.time(lambda: torch.autograd.backward(diff, grads))
    return f, b


@contextlib.contextmanager
def _buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Undo buffer updates (batch-norm statistics) of the extra checkpointed run."""
    saved = [b.detach().clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(module.buffers(), saved):
                b.copy_(v)


def _recompute_step(
    module: torch.nn.Module,
    inputs: Sequence[Any],
    grads: list[Tensor],
    clock: Clock,
    frozen: frozenset[int] = frozenset(),
) -> float:
    """Backward seconds of the unit under non-reentrant checkpointing, as a recomputing stage
    runs it: the forward again, the checkpoint's hooks, then the backward."""
    out = checkpoint(module, *_leaves(inputs, frozen), use_reentrant=False)
    diff = _differentiable(out)
    if not diff:
        return 0.0
    _, b = clock.time(lambda: torch.autograd.backward(diff, grads))
    return b


def _forwards(
    module: torch.nn.Module, inputs: Sequence[Any], clock: Clock, frozen: frozenset[int]
) -> tuple[float, float]:
    """Seconds of the unit's plain forward and of its forward under non-reentrant
    checkpointing, back to back (outputs dropped)."""
    leaves = _leaves(inputs, frozen)
    plain = clock.time(lambda: module(*leaves))[1]
    leaves = _leaves(inputs, frozen)
    return plain, clock.time(lambda: checkpoint(module, *leaves, use_reentrant=False))[1]


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
    fwd = _median_iqr([c[0] for c in ckpt])[0] - _median_iqr([p[0] for p in plain])[0]
    bwd = _median_iqr([c[1] for c in ckpt])[0] - _median_iqr([p[1] for p in plain])[0]
    return max(fwd, 0.0), max(bwd, 0.0)


def _median_iqr(samples: list[float]) -> tuple[float, float]:
    if not samples:
        return 0.0, 0.0
    q1, med, q3 = np.percentile(samples, [25, 50, 75])
    return float(med), float(q3 - q1)


def measure_unit(
    module: torch.nn.Module,
    inputs: Sequence[Any],
    *,
    clock: Clock,
    warmup: int,
    repeats: int,
    exclude: set[int],
    seed: int = 0,
    frozen: frozenset[int] = frozenset(),
) -> tuple[Timing, tuple[Any, ...]]:
    """Time ``module(*inputs)`` forward and backward; return the Timing and detached outputs.

    ``frozen`` lists the positions of inputs that get no gradient (the model's own inputs).
    """
    saved, out = saved_bytes(module, inputs, exclude, frozen)
    outputs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    grads = [
        torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device) for t in _differentiable(out)
    ]
    if warmup > 0:  # the counting forward doubles as the first warm-up
        if grads:
            torch.autograd.backward(_differentiable(out), grads)
        warmup -= 1
    del out
    fwd: list[float] = []
    bwd: list[float] = []
    rec: list[float] = []
    rec_f: list[float] = []
    peak: int | None = None
    for i in range(warmup + repeats):
        base = clock.reset_peak()
        f, b = _step(module, inputs, grads, clock, frozen)
        with _buffers_restored(module):
            r = _recompute_step(module, inputs, grads, clock, frozen)
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
            rec.append(r)
            used = clock.peak_since(base)
            if used is not None:
                peak = max(peak or 0, used)
    # The checkpointed forward's excess over the plain one, measured in a loop of forwards
    # only: how slow a forward is depends on what ran before it (20-40 % slower right after a
    # backward on a CPU), so both are timed in the same context and only their difference is
    # added to the plain forward measured above.
    plain_f: list[float] = []
    with _buffers_restored(module):
        for i in range(warmup + repeats):
            pf, rf = _forwards(module, inputs, clock, frozen)
            if i >= warmup:
                plain_f.append(pf)
                rec_f.append(rf)
    f_med, f_iqr = _median_iqr(fwd)
    b_med, b_iqr = _median_iqr(bwd)
    timing = Timing(
        recompute_backward_s=_median_iqr(rec)[0],
        recompute_forward_s=max(0.0, f_med + _median_iqr(rec_f)[0] - _median_iqr(plain_f)[0]),
        forward_s=f_med,
        backward_s=b_med,
        forward_spread_s=f_iqr,
        backward_spread_s=b_iqr,
        saved_bytes=saved,
        output_bytes=value_bytes(outputs),
        peak_bytes=peak,
    )
    detached = tuple(t.detach() if isinstance(t, Tensor) else t for t in outputs)
    return timing, detached


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
            out[name] = _median_iqr(times[max(warmup, 1) :])[0]
    finally:
        with torch.no_grad():
            for t, v in zip(params, saved):
                t.copy_(v)
                t.grad = None
    return out
