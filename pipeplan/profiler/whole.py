"""Profile a model: trace it, group it into units, and measure every unit at every micro-batch size.

Two methods (``method``, ``pipeplan profile --method``):

- ``whole`` (below): the real model, whole training passes.  It needs the whole model's
  training state in memory.
- ``units`` (:mod:`pipeplan.profiler.units`): the model built on ``meta``, each distinct unit
  materialized alone and measured once; for models that do not fit.
- ``auto`` (the default) takes ``whole`` when the model's training state fits in
  :data:`AUTO_MEMORY_FRACTION` of the memory available on the device, else ``units``:
  4 x parameter bytes (parameters, gradients, Adam's two states) + an activation estimate
  (every compute node's output at the largest micro-batch size, summed, from a run on
  ``meta``) <= 0.5 x available (CUDA: free device memory; CPU: ``MemAvailable``).

The ``whole`` method:

For each micro-batch size b the model runs whole training passes on a seeded batch of size b,
unit by unit, and every unit is timed inside them (:mod:`pipeplan.profiler.sweep`): forward in order,
the loss, backward in reverse, and the same again with every unit recomputing.  The cut table
comes from the largest size's run: every tensor live across a cut
(:func:`pipeplan.intake.graph.cut_tensors`) with its bytes divided by b.  Sizes are measured largest
first, so the warm-up of the largest (slowest) runs also warms the allocator for the rest.
On a CPU the heap keeps freed memory mapped, as the runtime's ranks do
(:mod:`pipeplan.planner.allocator`).  Last, every optimizer's step is timed over growing prefixes of
the units' parameters, the cache cold before each step (``Profile.update_curve``, and
``Profile.update_s`` over all of them; :mod:`pipeplan.planner.updates`).  What one checkpoint call adds
by itself (``Profile.checkpoint_call_s``) is timed before the passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from pipeplan.intake.model import load_model
from pipeplan.intake.refine import DEFAULT_MAX_STAGES
from pipeplan.intake.trace import run_eagerly, trace_model
from pipeplan.planner.allocator import keep_heap
from pipeplan.planner.errors import InvalidRequestError, PipeplanError
from pipeplan.planner.host import PROFILE_RANKS, threads_per_rank
from pipeplan.planner.types import Profile, Timing
from pipeplan.profiler.assemble import (
    LossModule,
    Recipe,
    assemble_profile,
    batch_dependent_layers,
    merge_rounds,
    split_model,
)
from pipeplan.profiler.device import Clock, available_bytes, resolve_device
from pipeplan.profiler.measure import (
    measure_checkpoint_call,
    measure_update_curve,
    storage_keys,
)
from pipeplan.profiler.sweep import measure_sweep
from pipeplan.profiler.units import activation_estimate, param_bytes
from pipeplan.report.progress import progress_bar

__all__ = [
    "AUTO_MEMORY_FRACTION",
    "DTYPES",
    "METHODS",
    "auto_method",
    "batch_dependent_layers",
    "default_microbatch_sizes",
    "profile_model",
]

#: ``method`` names accepted by :func:`profile_model`.
METHODS = ("auto", "whole", "units")

#: ``auto`` profiles whole passes when the training state fits in this share of the memory
#: available (the rest: the profiler's own copies, the allocator, other processes).
AUTO_MEMORY_FRACTION = 0.5

#: ``dtype`` names accepted by :func:`profile_model`.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def default_microbatch_sizes(batch_size: int) -> tuple[int, ...]:
    """Every power of two dividing ``batch_size``, and ``batch_size`` itself.

    >>> default_microbatch_sizes(24)
    (1, 2, 4, 8, 24)
    """
    sizes = [1 << i for i in range(batch_size.bit_length()) if batch_size % (1 << i) == 0]
    return tuple(sorted({*sizes, batch_size}))


def _check_sizes(batch_size: int, sizes: Sequence[int] | None) -> tuple[int, ...]:
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise InvalidRequestError(f"batch size must be a positive integer, got {batch_size!r}")
    if sizes is None:
        return default_microbatch_sizes(batch_size)
    out = tuple(sorted(set(sizes)))
    if not out:
        raise InvalidRequestError("no micro-batch sizes given; omit them to use the defaults")
    for b in out:
        if b <= 0 or batch_size % b:
            raise InvalidRequestError(
                f"micro-batch size {b} does not divide batch size {batch_size}; "
                f"choose among {list(default_microbatch_sizes(batch_size))} or other divisors"
            )
    return out


def _check_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, str | int | float | bool]:
    out: dict[str, str | int | float | bool] = {}
    for key, value in (kwargs or {}).items():
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidRequestError(
                f"model argument {key}={value!r} is a {type(value).__name__}; "
                f"a profile records only str, int, float and bool arguments"
            )
        out[key] = value
    return out


def _to(value: Any, dev: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dev, dtype) if value.is_floating_point() else value.to(dev)
    return value


def profile_model(
    model: str,
    *,
    batch_size: int,
    model_kwargs: Mapping[str, Any] | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    device: str = "cpu",
    granularity: str = "auto",
    tracer: str = "auto",
    dtype: str = "float32",
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
    threads: int | None = None,
    rounds: int = 1,
    max_stages: int = DEFAULT_MAX_STAGES,
    method: str = "auto",
    tensor_parallel: int = 1,
) -> Profile:
    """Measure ``model`` (``package.module:callable``) unit by unit; see the module docstring.

    ``method`` is ``whole``, ``units`` or ``auto`` (``whole`` where the model's training state
    fits in half the available memory, else ``units``; :func:`auto_method`).

    ``microbatch_sizes`` defaults to every power of two dividing ``batch_size`` (and
    ``batch_size``).  List or tuple model arguments are recorded as comma-separated strings.
    ``threads`` sets ``torch.set_num_threads`` while measuring on CPU (restored afterwards):
    profile with the thread count each pipeline rank will use.  By default it is what each
    rank of a 2-stage ``pipeplan run`` on this host gets, cores // 2
    (:mod:`pipeplan.planner.host`; ``plan`` and ``run`` warn where a plan's ranks get other).
    ``rounds`` repeats the whole sweep over sizes and units; each time is the median of the
    rounds' medians, so a burst of interference from other processes (which slows whatever runs
    during it) is outvoted instead of landing on one unit.  ``max_stages`` is the largest stage
    count the ``auto`` units are refined for (:mod:`pipeplan.intake.refine`): no unit heavier than
    1 / max_stages of the model where it can be split, and at least max_stages units.
    ``tensor_parallel`` t > 1 also measures every splittable unit split t ways on t ranks,
    ``threads`` each (:mod:`pipeplan.profiler.tp_measure`: ``Unit.tp_timings[t]``); the
    model's layout and t are checked before anything is measured.
    """
    if tensor_parallel < 1:
        raise InvalidRequestError(f"--tensor-parallel {tensor_parallel} must be at least 1")
    if tensor_parallel > 1:
        from pipeplan.intake.tp_layout import check_degree
        from pipeplan.profiler.tp_annotate import model_layout

        layout = model_layout(load_model(model, model_kwargs, meta=True).module)
        if isinstance(layout, str):
            raise InvalidRequestError(f"--tensor-parallel {tensor_parallel}: {layout}")
        check_degree(layout, tensor_parallel)
    if rounds < 1:
        raise InvalidRequestError(f"rounds {rounds} must be at least 1")
    if max_stages < 1:
        raise InvalidRequestError(f"--max-stages {max_stages} must be at least 1")
    if threads is not None and threads < 1:
        raise InvalidRequestError(f"threads {threads} must be at least 1")
    if method not in METHODS:
        raise InvalidRequestError(f"method {method!r} is not one of {', '.join(METHODS)}")
    if threads is None and resolve_device(device).type == "cpu":
        threads = threads_per_rank(PROFILE_RANKS)
    with _threads(threads):
        prof = _profile(
            model,
            batch_size,
            model_kwargs,
            microbatch_sizes,
            device,
            granularity,
            tracer,
            dtype,
            warmup,
            repeats,
            progress,
            rounds,
            max_stages,
            method,
        )
    if tensor_parallel > 1:
        from pipeplan.profiler.tp_measure import measure_tensor_parallel

        prof = measure_tensor_parallel(
            prof, tensor_parallel, warmup=warmup, repeats=repeats * rounds, threads=threads
        )
    return prof


def auto_method(param_bytes: int, activation_bytes: int, available: int) -> str:
    """``auto``'s choice: ``whole`` when the training state, 4 x ``param_bytes`` (parameters,
    gradients, Adam's two states) + ``activation_bytes``, fits in
    :data:`AUTO_MEMORY_FRACTION` of ``available``, else ``units``.

    >>> auto_method(1 << 30, 1 << 30, 16 << 30), auto_method(2 << 30, 1 << 30, 16 << 30)
    ('whole', 'units')
    """
    need = 4 * param_bytes + activation_bytes
    return "whole" if need <= AUTO_MEMORY_FRACTION * available else "units"


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` for the block (nothing when ``None``)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _profile(
    model: str,
    batch_size: int,
    model_kwargs: Mapping[str, Any] | None,
    microbatch_sizes: Sequence[int] | None,
    device: str,
    granularity: str,
    tracer: str,
    dtype: str,
    warmup: int,
    repeats: int,
    progress: bool,
    rounds: int = 1,
    max_stages: int = DEFAULT_MAX_STAGES,
    method: str = "whole",
) -> Profile:
    sizes = _check_sizes(batch_size, microbatch_sizes)
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if warmup < 0 or repeats < 1:
        raise InvalidRequestError(
            f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}"
        )
    if tracer not in ("auto", "fx", "export"):
        raise InvalidRequestError(f"tracer {tracer!r} is not one of auto, fx, export")
    recipe = Recipe(
        model=model,
        model_kwargs=_check_kwargs(model_kwargs),
        dtype=dtype,
        batch_size=batch_size,
        sizes=sizes,
        granularity=granularity,
        warmup=warmup,
        repeats=repeats,
        rounds=rounds,
    )
    dev = resolve_device(device)
    torch_dtype = DTYPES[dtype]
    if dev.type == "cpu":
        keep_heap()  # the heap the runtime's ranks run with (see pipeplan.planner.allocator)
    free = available_bytes(dev)
    weights = 0
    if method == "auto":  # the parameters first, from the model built on meta: no memory
        try:
            weights = param_bytes(load_model(model, model_kwargs, meta=True).module, torch_dtype)
        except PipeplanError:  # a model that cannot be built on meta: count it built for real
            weights = -1
        if auto_method(weights, 0, free) == "units":
            method = "units"
    spec = None
    if method != "units":
        spec = load_model(model, model_kwargs)
        module = spec.module.to(dev, torch_dtype).train()
        example = tuple(_to(x, dev, torch_dtype) for x in spec.batch(max(sizes))[0])
        run_eagerly(module, example)  # a bug in forward: the user's file and line, not the tracer's
        traced = trace_model(module, example, tracer)  # type: ignore[arg-type]
        if method == "auto":  # then the activations, from the traced graph run on meta
            weights = weights if weights >= 0 else param_bytes(module, torch_dtype)
            method = auto_method(weights, activation_estimate(traced, example), free)
            if method == "units":
                del spec, module, example, traced
    if method == "units":
        from pipeplan.profiler.units import profile_units

        with progress_bar(progress) as bar:

            def start(description: str, total: int) -> Callable[[str], None]:
                task = bar.add_task(description, total=total)
                return lambda text: bar.update(task, description=text, advance=1)

            return profile_units(
                recipe,
                model_kwargs=model_kwargs,
                dev=dev,
                torch_dtype=torch_dtype,
                tracer=tracer,
                max_stages=max_stages,
                progress=start,
            )

    assert spec is not None
    split = split_model(traced, example, granularity, max_stages)
    pieces, placeholders = split.pieces, split.placeholders
    exclude = storage_keys([*traced.gm.parameters(), *traced.gm.buffers()])
    clock = Clock(dev)

    runs: list[dict[int, list[Timing]]] = [{b: [] for b in sizes} for _ in pieces]
    loss_runs: dict[int, list[Timing]] = {b: [] for b in sizes}
    (output_node,) = [n for n in traced.gm.graph.nodes if n.op == "output"]

    def output(lookup: Callable[[str], Any]) -> Any:
        flat = torch.fx.node.map_arg(output_node.args[0], lambda n: lookup(n.name))
        return traced.gm.graph.process_outputs(flat)  # export graphs return it flattened

    call_s = measure_checkpoint_call(dev, clock=clock, warmup=warmup, repeats=20 * repeats * rounds)
    biggest: dict[str, Any] = {}
    with progress_bar(progress) as bar:
        task = bar.add_task(model, total=rounds * len(sizes))
        for b in [b for _ in range(rounds) for b in sorted(sizes, reverse=True)]:
            bar.update(task, description=f"{model} b={b}")
            batch_inputs, target = spec.batch(b)
            inputs = tuple(_to(x, dev, torch_dtype) for x in batch_inputs)
            if len(inputs) != len(placeholders):
                raise InvalidRequestError(
                    f"model {model!r} takes {len(placeholders)} inputs but make_batch gave "
                    f"{len(inputs)}"
                )
            result = measure_sweep(
                pieces,
                dict(zip(placeholders, inputs)),
                LossModule(spec.loss, _to(target, dev, torch_dtype)),
                output,
                clock=clock,
                warmup=warmup,
                repeats=repeats,
                exclude=exclude,
                call_s=call_s,
            )
            for k, timing in enumerate(result.units):
                runs[k][b].append(timing)
            loss_runs[b].append(result.loss)
            if b == max(sizes):
                biggest = result.values
            bar.advance(task)
        for param in traced.gm.parameters():  # the passes' accumulated gradients
            param.grad = None

    named = dict(traced.gm.named_parameters())
    update_curve = measure_update_curve(
        [[named[n] for n in p.params if n in named] for p in pieces],
        clock=clock,
        warmup=warmup,
        repeats=repeats * rounds,
    )
    return assemble_profile(
        recipe,
        split,
        module=spec.module,
        dev=dev,
        values=biggest,
        timings=[{b: merge_rounds(ts) for b, ts in per_size.items()} for per_size in runs],
        loss={b: merge_rounds(ts) for b, ts in loss_runs.items()},
        update_curve=update_curve,
        call_s=call_s,
        method="whole",
    )
