"""Batch normalisation in a pipeline: running statistics once per mini-batch (torchgpipe's
``DeferredBatchNorm``).

A pipeline runs each BatchNorm on one micro-batch at a time.  Two things change against the
unsplit model on the whole batch:

1. the normalisation uses each micro-batch's own mean and variance (so the step's gradients
   are those of m smaller batches): inherent to micro-batching, kept as it is;
2. the running statistics are updated m times per step, each from b = B / m samples: this is
   what ``deferred`` fixes.  Each micro-batch's sum and sum of squares per channel are
   accumulated; after the step's m-th micro-batch the running mean and (unbiased) variance are
   updated once, with the batch's statistics over all B samples, exactly as the unsplit model
   updates them, and ``num_batches_tracked`` grows by one.

A recomputation (activation checkpointing runs a stage's forward again in its backward) does
not count: :func:`recomputing` marks it, and ``pipeplan.runtime.engine.Recompute`` enters it;
:func:`preserved_buffers` restores every buffer after a recomputation or a probe.

:func:`defer_batch_norm` rewrites a traced graph in place: a ``torch.fx`` graph's BatchNorm
modules (``call_module`` nodes) are wrapped in :class:`_DeferredModule`; a ``torch.export``
graph's ``aten.batch_norm`` calls on the module's running buffers become
:func:`_deferred_batch_norm`, and its ``num_batches_tracked.add_(1)`` becomes a no-op (the
commit counts the step once).  The graph keeps its nodes, so the units do not change.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import GraphModule
from torch.nn.modules.batchnorm import _BatchNorm

from pipeplan.intake.trace import TracedModel, get_attr

__all__ = [
    "BATCH_NORM_MODES",
    "DeferredStats",
    "defer_batch_norm",
    "preserved_buffers",
    "recomputing",
    "restore_batch_norm",
]

#: ``pipeplan run --batch-norm`` choices.
BATCH_NORM_MODES = ("deferred", "microbatch")

_state = threading.local()


@contextlib.contextmanager
def preserved_buffers(module: nn.Module) -> Iterator[None]:
    """Restore every buffer of ``module`` on exit (a probe or a recomputation must not count
    a batch-norm batch twice)."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Inside this block BatchNorm statistics are not tracked (a recomputed forward)."""
    before = getattr(_state, "recomputing", False)
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = before


class DeferredStats:
    """One BatchNorm's per-channel sums over a step's micro-batches, committed after ``chunks``.

    ``running_mean``, ``running_var`` and ``num_batches_tracked`` are the layer's own buffers,
    updated in place by :meth:`commit` with ``momentum`` (``None``: cumulative average).
    """

    def __init__(
        self,
        running_mean: Tensor,
        running_var: Tensor,
        num_batches_tracked: Tensor | None,
        momentum: float | None,
        chunks: int,
    ) -> None:
        self.running_mean, self.running_var = running_mean, running_var
        self.num_batches_tracked = num_batches_tracked
        self.momentum, self.chunks = momentum, chunks
        self.reset()

    def reset(self) -> None:
        self.sum = torch.zeros_like(self.running_mean)
        self.sum_squares = torch.zeros_like(self.running_var)
        self.count, self.tracked = 0, 0

    def track(self, x: Tensor) -> None:
        """Add micro-batch ``x`` (N, C, ...) to the sums; commit after the step's last one."""
        if getattr(_state, "recomputing", False):
            return
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            xs = x.detach().to(self.sum.dtype)
            self.sum += xs.sum(dims)
            self.sum_squares += (xs * xs).sum(dims)
        self.count += x.numel() // x.size(1)
        self.tracked += 1
        if self.tracked == self.chunks:
            self.commit()

    def commit(self) -> None:
        """Update the running statistics once with the whole batch's mean and variance."""
        n = self.count
        with torch.no_grad():
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
            if self.momentum is None:
                tracked = self.num_batches_tracked
                factor = 1.0 / float(tracked) if tracked is not None else 0.0
            else:
                factor = self.momentum
            mean = self.sum / n
            var = (self.sum_squares / n - mean * mean) * (n / max(n - 1, 1))
            self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            self.running_var.mul_(1 - factor).add_(var, alpha=factor)
        self.reset()


class _DeferredModule(nn.Module):
    """A BatchNorm module that normalises as usual and tracks into :class:`DeferredStats`."""

    def __init__(self, bn: _BatchNorm, stats: DeferredStats) -> None:
        super().__init__()
        self.bn = bn
        self.stats = stats

    def forward(self, x: Tensor) -> Tensor:
        bn = self.bn
        if not bn.training:
            return bn(x)
        self.stats.track(x)
        return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)


_REGISTRY: dict[int, DeferredStats] = {}


def _deferred_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    *rest: Any,
) -> Tensor:
    """``aten.batch_norm``'s signature; tracks into the stats registered for ``running_mean``."""
    stats = _REGISTRY.get(id(running_mean)) if running_mean is not None else None
    if not training or stats is None:
        return torch.ops.aten.batch_norm.default(
            x, weight, bias, running_mean, running_var, training, momentum, eps, *rest
        )
    stats.track(x)
    return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


def defer_batch_norm(traced: TracedModel, chunks: int) -> list[DeferredStats]:
    """Make every BatchNorm of ``traced`` update its running statistics once per ``chunks``
    micro-batches (see the module docstring); returns their :class:`DeferredStats`.

    The graph is changed in place (:func:`restore_batch_norm` undoes it).  Call it before
    building the stages (they copy the graph); reset the stats after anything that runs the
    graph outside a step (``pipeplan.runtime.probe.probe``).
    """
    gm = traced.gm
    out: list[DeferredStats] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            if isinstance(sub, _DeferredModule):  # converted before: new stats for this m
                sub = sub.bn
            if (
                isinstance(sub, _BatchNorm)
                and sub.running_mean is not None
                and sub.running_var is not None
            ):
                stats = _stats(
                    sub.running_mean, sub.running_var, sub.num_batches_tracked, sub.momentum, chunks
                )
                gm.set_submodule(str(node.target), _DeferredModule(sub, stats))
                out.append(stats)
        elif node.op == "call_function" and node.target in (
            torch.ops.aten.batch_norm.default,
            _deferred_batch_norm,
        ):
            args = list(node.args)
            if len(args) < 8 or args[3] is None or not args[5]:
                continue
            mean, var = (get_attr(gm, str(a.target)) for a in (args[3], args[4]))
            tracked = _num_batches_tracked(gm, str(args[3].target))
            stats = _stats(mean, var, tracked, args[6], chunks)
            _REGISTRY[id(mean)] = stats
            node.meta["pipeplan_target"] = torch.ops.aten.batch_norm.default
            node.target = _deferred_batch_norm
            out.append(stats)
    for node in list(gm.graph.nodes):  # export's num_batches_tracked += 1: the commit counts
        if (
            out
            and node.op == "call_function"
            and node.target is torch.ops.aten.add_.Tensor
            and getattr(node.args[0], "op", None) == "get_attr"
            and str(node.args[0].target).endswith("num_batches_tracked")
        ):
            node.meta["pipeplan_target"] = node.target
            node.target = _unchanged
    gm.graph.lint()
    gm.recompile()
    return out


def restore_batch_norm(traced: TracedModel) -> None:
    """Undo :func:`defer_batch_norm`: running statistics once per micro-batch again."""
    gm = traced.gm
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            if isinstance(sub, _DeferredModule):
                gm.set_submodule(str(node.target), sub.bn)
        elif "pipeplan_target" in node.meta:
            node.target = node.meta.pop("pipeplan_target")
    gm.recompile()


def _unchanged(tensor: Tensor, *_: Any) -> Tensor:
    return tensor


def _stats(
    mean: Tensor, var: Tensor, tracked: Tensor | None, momentum: float | None, chunks: int
) -> DeferredStats:
    return DeferredStats(mean, var, tracked, momentum, chunks)


def _num_batches_tracked(gm: GraphModule, running_mean: str) -> Tensor | None:
    """The ``num_batches_tracked`` buffer beside a ``running_mean`` buffer, if any."""
    head, _, _ = running_mean.rpartition(".")
    for name in (f"{head}.num_batches_tracked" if head else "num_batches_tracked",):
        try:
            value = get_attr(gm, name)
        except AttributeError:
            return None
        return value if isinstance(value, Tensor) else None
    return None
