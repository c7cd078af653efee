"""Run one rank's stages (chunks) of a plan with ``torch.distributed.pipelining``.

Each rank builds every stage module (they share the model's parameters, so this is cheap),
keeps its own, and hands each to a :class:`~torch.distributed.pipelining.PipelineStage` with
static metadata from :func:`pipeplan.runtime.stages.build_stages`.  A plan of p ranks runs
p v stages, v per rank (``plan.stages_per_rank``; rank r holds the chunks
:func:`pipeplan.planner.families.stages_of_rank` names: r alone for GPipe and 1F1B, a loop
or a V for the multi-chunk families).  The schedule is the family's torch class
(:data:`pipeplan.planner.families.FAMILIES`), whose action lists the planner replayed; it
splits the batch into ``plan.microbatches`` micro-batches.  With one chunk per rank torch
divides the gradients by m; with several the runner divides them once after the step
(``scale_grads=False``, :mod:`pipeplan.runtime.gradsync`).  With a loss that is a batch mean
the result is the full batch's gradient.

A stage with ``recompute`` runs inside ``torch.utils.checkpoint(use_reentrant=False)``: only
its inputs are kept per micro-batch and its forward is run again in the backward pass, with
the RNG state restored and buffer updates (batch-norm statistics) of the rerun undone.

With ``cluster.tensor_parallel`` t > 1 each stage runs on t ranks, its attention and MLP
projections split over them by torch's ``parallelize_module``, and rank (r p + j) t + k runs
replica r's position j (:mod:`pipeplan.runtime.mesh` says what runs where).

A parameter held by stages on several ranks (tied embedding / LM head) gets its gradient
summed over the ranks that hold it before the optimizer steps, and with d replicas every
gradient is averaged over them (:mod:`pipeplan.runtime.gradsync`).

The runner's other jobs live beside it: this rank's weights, initialised or read from a
checkpoint and saved (:mod:`pipeplan.runtime.weights`), the model's loss on the last stage's
output (:mod:`pipeplan.runtime.loss`), each stage's F, B, I and W timed
(:mod:`pipeplan.runtime.measured_stage`) and the bytes held at a step's start
(:func:`pipeplan.runtime.memory.held_bytes`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.microbatch import _CustomReducer
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from pipeplan.intake.graph import group_units
from pipeplan.intake.meta import has_meta, trace_meta
from pipeplan.intake.model import ModelSpec
from pipeplan.intake.spec import cast_batch, cast_floating
from pipeplan.intake.tp_sequence import SequenceRole, hidden_size, local_share
from pipeplan.intake.trace import TracedModel, trace_model
from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.families import FAMILIES, rank_of_stage, stages_of_rank
from pipeplan.planner.optim import make_optimizer
from pipeplan.planner.types import Plan
from pipeplan.runtime.batchnorm import (
    BATCH_NORM_MODES,
    defer_batch_norm,
    preserved_buffers,
    recomputing,
    restore_batch_norm,
)
from pipeplan.runtime.gradsync import (
    average_replicas,
    divide_microbatches,
    sum_tied,
    tied_groups,
)
from pipeplan.runtime.loss import StageLoss, VocabSplit, vocab_size
from pipeplan.runtime.measured_stage import FaultHook, MeasuredStage
from pipeplan.runtime.memory import TensorPeak, held_bytes
from pipeplan.runtime.mesh import (
    local,
    plan_mesh,
    shard_stage_modules,
    split_stage_modules,
    tensor_parallel_styles,
)
from pipeplan.runtime.records import RankRecord
from pipeplan.runtime.stages import (
    build_stages,
    check_schedule,
    parameter_names,
    tied_parameters,
)
from pipeplan.runtime.timing import Span, StepTimer
from pipeplan.runtime.weights import materialize_chunks, shard_tensors

__all__ = [
    "PipelineRunner",
    "Recompute",
]


class Recompute(nn.Module):
    """Run ``inner`` under non-reentrant activation checkpointing when autograd is on."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def _contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        return contextlib.nullcontext(), _recompute_context(self.inner)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=self._contexts)


@contextlib.contextmanager
def _recompute_context(inner: nn.Module) -> Iterator[None]:
    """A recomputed forward: buffers restored afterwards, batch-norm statistics not tracked."""
    with preserved_buffers(inner), recomputing():
        yield


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"plan dtype {name!r} is not a torch dtype; e.g. float32")
    return dtype


class PipelineRunner:
    """This rank's stages of ``plan``: ``forward_backward`` then ``optimizer_step``.

    Rank r of replica d (global rank d p + r) runs the chunks ``stages_of_rank`` names (stage
    r for GPipe and 1F1B).  ``spec.module`` must hold the same initial parameters on every
    rank.  ``traced`` (``spec.module`` already traced, in the plan's dtype)
    saves tracing it again.
    """

    def __init__(
        self,
        plan: Plan,
        spec: ModelSpec,
        *,
        device: torch.device,
        optimizer: str = "sgd",
        lr: float = 1e-3,
        fault: FaultHook | None = None,
        traced: TracedModel | None = None,
        batch_norm: str = "deferred",
        seed: int = 0,
        weights: str | None = None,
    ) -> None:
        p, v, t = plan.pipeline_ranks, plan.stages_per_rank, plan.cluster.tensor_parallel
        world, ranks = dist.get_world_size(), p * plan.cluster.data_parallel * t
        if world != ranks:
            tp = f" x {t} tensor-parallel" if t > 1 else ""
            raise InvalidRequestError(
                f"plan has {p} ranks x {plan.cluster.data_parallel} replicas{tp} but the world "
                f"size is {world}; launch one rank per stage, replica and tensor-parallel "
                f"rank (--nproc-per-node {ranks})"
            )
        check_schedule(plan)
        self.replicas, self.ranks, self.tensor_parallel = plan.cluster.data_parallel, p, t
        self.replica, rank = divmod(dist.get_rank() // t, p)  # rank (r p + j) t + k
        self.chunks = stages_of_rank(plan.schedule, p, v, rank)
        """The stages (chunks) this rank runs, in the order torch's schedule takes them."""
        self.owner = rank_of_stage(plan.schedule, p, v)
        self.mesh = plan_mesh(plan, device)
        self.tp_rank = self.mesh.tp_rank
        """This rank's index k among its stage's t tensor-parallel ranks."""
        self.pp_group, self.dp_group = self.mesh.pp_group, self.mesh.dp_group
        self.sharded = plan.cluster.data_parallel_mode == "shard" and self.replicas > 1
        """Whether FSDP2 shards the rank's stages over the dp group (:mod:`~pipeplan.runtime.mesh`)."""
        styles = tensor_parallel_styles(spec.module, t) if t > 1 else {}
        hidden = hidden_size(spec.module, styles) if t > 1 and plan.cluster.sequence_parallel else 0
        vocab = vocab_size(spec.module, styles) if t > 1 and plan.cluster.loss_parallel else 0
        self.plan, self.rank, self.device = plan, rank, device
        self.dtype = _dtype(plan.dtype)
        module = cast_floating(spec.module, self.dtype)
        inputs, _ = cast_batch(*spec.batch(plan.microbatch_size), self.dtype, torch.device("cpu"))
        on_meta = has_meta(module)
        if traced is None:
            trace = trace_meta if on_meta else trace_model
            traced = trace(module, inputs, tracer=plan.tracer)
        if batch_norm not in BATCH_NORM_MODES:
            raise InvalidRequestError(
                f"batch norm mode {batch_norm!r} is not one of {', '.join(BATCH_NORM_MODES)}"
            )
        deferred = []
        if batch_norm == "deferred":
            deferred = defer_batch_norm(traced, plan.microbatches)
            tracking = sum(
                isinstance(m, _BatchNorm) and m.training and m.running_mean is not None
                for m in module.modules()
            )
            if len(deferred) < tracking and rank == 0:
                print(
                    f"warning: --batch-norm deferred found {len(deferred)} of the model's "
                    f"{tracking} BatchNorm layers in the {traced.tracer} graph; the others "
                    f"update their running statistics once per micro-batch",
                    file=sys.stderr,
                    flush=True,
                )
        else:
            restore_batch_norm(traced)
        units = group_units(traced, plan.granularity, plan.unit_expansions)
        programs = build_stages(plan, traced, units, inputs, device=device)
        for stats in deferred:  # the probe ran the graph once
            stats.reset()
        self.names = parameter_names(module, traced.gm)
        self.tied = [
            t
            for t in tied_parameters([p.module for p in programs], self.names)
            if len({self.owner[s] for s in t.stages}) > 1
        ]
        """The parameters held on two or more ranks (their gradients are summed over them)."""
        mine = [programs[s] for s in self.chunks]
        self._module = module
        self.materialized: list[str] = []
        self.checkpoint_reads: list[str] = []
        """The checkpoint tensors this rank read (``weights``)."""
        if on_meta or weights is not None:
            self.materialized, self.checkpoint_reads = materialize_chunks(
                module,
                [pr.module for pr in mine],
                device,
                seed=seed,
                init_weights=spec.init_weights,
                weights=weights,
            )
        self.chunk_modules = [pr.module.to(device) for pr in mine]
        self.stage_module = self.chunk_modules[0]
        self.recompute = plan.stages[self.chunks[0]].recompute
        n = plan.n_stages
        self.is_first, self.is_last = 0 in self.chunks, n - 1 in self.chunks
        self._last_outputs = programs[n - 1].example_outputs

        def to_dev(ts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return tuple(t.to(device).requires_grad_(t.requires_grad) for t in ts)

        self.timer = StepTimer(device)
        split = VocabSplit.of(self.mesh.tp_mesh, vocab, programs[n - 1].example_outputs)
        self.loss = StageLoss(
            spec.loss, programs[n - 1].module, self.timer, rank, split if vocab else None
        )
        """The model's loss on the last stage's output: the schedule's ``loss_fn``."""
        bodies: list[nn.Module] = [
            Recompute(body) if plan.stages[s].recompute else body
            for s, body in zip(self.chunks, self.chunk_modules, strict=True)
        ]

        def sent(ts: tuple[Tensor, ...], whole: bool) -> tuple[Tensor, ...]:
            """A cut's tensors as they travel: a hidden state as this rank's share of the
            sequence under sequence parallelism (:mod:`pipeplan.intake.tp_sequence`)."""
            return to_dev(ts) if whole or not hidden else local_share(to_dev(ts), hidden, k, t)

        k = self.tp_rank
        if t > 1:  # the split runs the bodies once: before the deferred statistics reset
            examples = [
                (
                    pr.module.body,
                    pr.module.body_inputs(*to_dev(pr.example_inputs)),
                    SequenceRole(hidden, pr.module.received if pr.index else (), pr.index == n - 1)
                    if hidden
                    else None,
                    bool(vocab) and pr.index == n - 1,
                )
                for pr in mine
            ]
            self.names = split_stage_modules(
                examples, self.chunk_modules, self.mesh, styles, self.names, module
            )
            if vocab and self.is_last:  # the loss on split logits, checked once (before FSDP2)
                pr = programs[n - 1]
                with torch.no_grad(), preserved_buffers(pr.module):
                    outs = pr.module(*sent(pr.example_inputs, pr.index == 0))
                target = cast_batch(*spec.batch(plan.microbatch_size), self.dtype, device)[1]
                split.check(self.loss, outs, target)
            for stats in deferred:
                stats.reset()
        if self.sharded:
            self.names = shard_stage_modules(bodies, self.mesh, self.names, module)
        self.stages: list[MeasuredStage] = []
        for s, pr, body in zip(self.chunks, mine, bodies, strict=True):
            stage = MeasuredStage(
                body,
                s,
                n,
                device,
                input_args=sent(pr.example_inputs, pr.index == 0),
                output_args=split.local(to_dev(pr.example_outputs))
                if vocab and pr.index == n - 1
                else sent(pr.example_outputs, pr.index == n - 1),
                group=self.pp_group,
            )
            stage.timer, stage.fault, stage.step_index = self.timer, fault, 0
            stage.whole_backward = (
                plan.stages[s].recompute and FAMILIES[plan.schedule].split_backward
            )
            self.stages.append(stage)
        self.stage = self.stages[0]
        del programs, mine
        schedule_cls = getattr(schedules, FAMILIES[plan.schedule].torch_class)
        self.unscaled = v > 1
        """Whether the schedule leaves the gradients summed over the micro-batches (v > 1: it
        is built with ``scale_grads=False``, see :mod:`pipeplan.runtime.gradsync`)."""
        # The last stage's outputs are left unmerged: the loss is all the runner reads, and
        # torch's default merge concatenates every output on dim 0, which a 0-dim one lacks.
        drop = tuple(_CustomReducer(None, _drop) for _ in self._last_outputs)
        self.schedule = schedule_cls(
            self.stages[0] if v == 1 else self.stages,
            n_microbatches=plan.microbatches,
            loss_fn=self.loss,
            output_merge_spec=drop,
            scale_grads=not self.unscaled,
        )
        self.params = list(dict.fromkeys(p for m in self.chunk_modules for p in m.parameters()))
        self.optimizer = make_optimizer(optimizer, self.params, lr)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        """The rank's parameters in the optimizer's order (its state's indices)."""
        self.tied_groups = tied_groups(
            self.tied,
            self.named_parameters(),
            self.owner,
            rank=rank,
            ranks=p,
            replica=self.replica,
            replicas=self.replicas,
            tensor_parallel=t,
            tp_rank=self.tp_rank,
        )
        """This rank's process groups of the ranks holding its tied parameters."""

    def shard_tensors(self) -> dict[str, Tensor]:
        """This rank's parameters and persistent buffers (all its chunks') by checkpoint key,
        each once, as the rank's shard of a sharded safetensors checkpoint
        (:func:`pipeplan.runtime.weights.shard_tensors`; :mod:`pipeplan.runtime.saving`
        writes it)."""
        return shard_tensors(
            self._module,
            self.chunk_modules,
            names=self.names,
            tied=self.tied,
            owner=self.owner,
            rank=self.rank,
        )

    # -- one step --------------------------------------------------------------------------

    def forward_backward(
        self, inputs: tuple[Tensor, ...], target: Tensor, step: int = 0
    ) -> float | None:
        """One pipelined forward and backward of the full batch; tied gradients summed.

        Every rank passes the same batch (only stage 0 uses the inputs, only the last stage
        the target).  Returns the batch's loss on the last stage, ``None`` elsewhere.
        """
        self.optimizer.zero_grad(set_to_none=True)
        for stage in self.stages:
            stage.step_index = step
        self.loss.calls = 0
        if self.replicas > 1:
            inputs, target = self._share(inputs, target)
        inputs, target = cast_batch(inputs, target, self.dtype, self.device)
        args = inputs if self.is_first else ()
        kwargs: dict[str, Any] = {"return_outputs": False}
        losses: list[Tensor] = []
        if self.is_last:
            kwargs.update(target=target, losses=losses)
        split = self.loss.split if self.is_last else None
        with split.context() if split is not None else contextlib.nullcontext():
            self.schedule.step(*args, **kwargs)
        if self.unscaled:
            divide_microbatches(self.params, self.plan.microbatches)
        if self.tied_groups:
            with self.timer.span("tied", -1):
                sum_tied(self.tied_groups)
        if self.dp_group is not None and not self.sharded:  # FSDP2 averaged them already
            with self.timer.span("replicas", -1):
                average_replicas(self.params, self.dp_group, self.replicas)
        if not self.is_last:
            return None
        loss = torch.stack([local(loss.detach()) for loss in losses]).mean()
        if self.dp_group is not None:  # the global batch's mean over the replicas' shares
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.dp_group)
            loss = loss / self.replicas
        return float(loss)

    def _share(self, inputs: tuple[Tensor, ...], target: Any) -> tuple[tuple[Tensor, ...], Any]:
        """This replica's rows of the global batch: replica r takes rows r B/d .. (r+1) B/d."""
        rows = inputs[0].shape[0]
        if rows % self.replicas:
            raise InvalidRequestError(
                f"a batch of {rows} does not split over {self.replicas} replicas"
            )
        n = rows // self.replicas
        cut = slice(self.replica * n, (self.replica + 1) * n)
        return tuple(t[cut] for t in inputs), tree_map(
            lambda t: t[cut] if isinstance(t, Tensor) else t, target
        )

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def timed_step(
        self, inputs: tuple[Tensor, ...], target: Tensor, step: int
    ) -> tuple[float, list[Span], float | None]:
        """A full training step after a barrier: (wall seconds, spans, loss or None)."""
        dist.barrier()
        self.timer.begin()
        loss = self.forward_backward(inputs, target, step)
        with self.timer.span("optimizer", -1):
            self.optimizer_step()
        wall, spans = self.timer.end()
        return wall, spans, loss

    def measure(
        self,
        inputs: tuple[Tensor, ...],
        target: Tensor,
        record: RankRecord,
        *,
        warmup: int,
        steps: int,
        on_step: Callable[[int], None] | None = None,
        start: int = 0,
        after_step: Callable[[int], None] | None = None,
    ) -> RankRecord:
        """Run ``warmup + steps`` timed steps into ``record``: the walls and spans of the
        measured steps, and every step's loss (last stage).  Steps are numbered from ``start``
        (the steps a resumed run has done); ``on_step(step)`` runs before each and
        ``after_step(step + 1)`` after its optimizer update (a save).

        On CPU the last warm-up step runs with its allocations tracked
        (:class:`pipeplan.runtime.memory.TensorPeak`): ``record.peak_memory_bytes`` is the bytes of the
        tensors alive at its start (the first stage's batch among them) plus the peak of its
        allocations.  With no warm-up it stays
        ``None`` (a tracked step runs slower, so it is never a measured one).
        """
        tracked = start + warmup - 1 if self.device.type == "cpu" and warmup > 0 else None
        for step in range(start, start + warmup + steps):
            if on_step is not None:
                on_step(step)
            if step == tracked:
                # The step would free last step's gradients first; free them before it, as
                # the profiler does not see the release of memory allocated before it started.
                self.optimizer.zero_grad(set_to_none=True)
                tracker = TensorPeak()
                live = held_bytes(
                    self.stages,
                    self.chunk_modules,
                    self.params,
                    self.optimizer,
                    inputs if self.is_first else (),
                )
                with tracker.track(live):
                    wall, spans, loss = self.timed_step(inputs, target, step)
                record.peak_memory_bytes = tracker.peak_bytes
            else:
                wall, spans, loss = self.timed_step(inputs, target, step)
            if loss is not None:
                record.losses.append(loss)
            if step >= start + warmup:
                record.walls.append(wall)
                record.spans.append(spans)
            if after_step is not None:
                after_step(step + 1)
        return record

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under the model's qualified names (a shared one once)."""
        return {self.names[id(p)]: p for p in self.params}  # type: ignore[misc]


def _drop(merged: None, output: Tensor) -> None:
    """A last-stage output merged over micro-batches: dropped (the runner reads the losses)."""
