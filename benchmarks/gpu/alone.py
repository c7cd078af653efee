"""Each stage of a multi-stage plan measured alone on one device: how one GPU checks a plan of p.

Stage j of plan P runs by itself, in one process: the model is built on ``meta``
(:func:`pipeplan.intake.model.load_model`), traced and cut into P's stages exactly as a rank of
``pipeplan run`` cuts it (:func:`pipeplan.runtime.stages.build_stages`), and only stage j's
modules get storage on the device (:func:`pipeplan.intake.meta.materialize`, the path
``pipeplan run --init stage`` takes).  It then runs the schedule's operations of its rank in
order (torch's, :func:`pipeplan.planner.families.action_order`: GPipe's F0..F(m-1)
B0..B(m-1), or 1F1B's), on stand-in inputs (random tensors of the shapes the stage receives; the real batch
on stage 0; one per micro-batch, as the pipeline keeps them) and a stand-in output gradient
(random, of the shapes it sends, one buffer reused as a receive buffer is; the model's loss on
the last stage), then the optimizer's step.  Nothing is sent: the plan's t_j = F + B + C is
compared with the measured F + B, and C reported beside it.

Per stage: ``measured_s`` (the median over ``repeats`` steps of the step's forwards and
backwards, divided by m: a micro-batch's F + B), ``predicted_s`` (the plan's F + B),
``peak_bytes`` (CUDA's ``max_memory_allocated`` over a measured step, after a warm-up step
that created the optimizer's state, less what the process held on the GPU before the stage was
materialized, ``held_before_bytes``; on CPU the live tensors at its start plus the peak of its
tracked allocations, as ``pipeplan run`` counts them) and ``predicted_bytes`` (the plan's M_j).
The stage is put back on ``meta`` before the next one is built.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import Tensor

from pipeplan.intake.graph import group_units
from pipeplan.intake.meta import dematerialize, materialize, trace_meta
from pipeplan.intake.model import load_model
from pipeplan.intake.spec import cast_batch, cast_floating
from pipeplan.planner.families import action_order
from pipeplan.planner.optim import make_optimizer
from pipeplan.planner.types import Plan
from pipeplan.runtime.engine import Recompute
from pipeplan.runtime.memory import TensorPeak, live_bytes
from pipeplan.runtime.stages import build_stages

__all__ = ["measure_stages"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stand_in(example: Tensor, device: torch.device, grad: bool) -> Tensor:
    """A random tensor like ``example`` (its shape and dtype) on ``device``."""
    if example.is_floating_point():
        t = torch.randn(example.shape, dtype=example.dtype, device=device)
        return t.requires_grad_(grad and example.requires_grad)
    return torch.zeros(example.shape, dtype=example.dtype, device=device)


def measure_stages(
    plan: Plan, device: torch.device, *, repeats: int = 3, seed: int = 0
) -> list[dict[str, Any]]:
    """Measure every stage of ``plan`` alone on ``device``; one record per stage (see the
    module docstring)."""
    dtype = _DTYPES[plan.dtype]
    spec = load_model(plan.model, dict(plan.model_kwargs), meta=True)
    module = cast_floating(spec.module, dtype)
    b, m = plan.microbatch_size, plan.microbatches
    torch.manual_seed(seed)
    inputs, target = cast_batch(*spec.batch(b), dtype, torch.device("cpu"))
    traced = trace_meta(module, inputs, tracer=plan.tracer)
    units = group_units(traced, plan.granularity, plan.unit_expansions)
    programs = build_stages(plan, traced, units, inputs, device=device)
    names = {id(t): n for n, t in module.named_parameters(remove_duplicate=False)}
    names |= {id(t): n for n, t in module.named_buffers(remove_duplicate=False)}
    records = []
    for j, prog in enumerate(programs):
        wanted = [names[id(t)] for t in [*prog.module.parameters(), *prog.module.buffers()]]
        # what the process holds on the GPU already (a stage before this one that failed and
        # left its tensors) is not this stage's: the peak is counted from here
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        mods = materialize(module, wanted, device, seed=seed, init_weights=spec.init_weights)
        busy, peak = _measure(plan, j, prog, spec, inputs, target, device, repeats)
        peak -= before
        s = plan.stages[j]
        records.append(
            {
                "stage": j,
                "measured_s": busy / m,
                "predicted_s": s.forward_s + s.backward_s,
                "comm_s": s.comm_s,
                "peak_bytes": peak,
                "predicted_bytes": s.memory.total,
                "held_before_bytes": before,
            }
        )
        dematerialize(module, mods, prog.module)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def _measure(
    plan: Plan,
    j: int,
    prog: Any,
    spec: Any,
    inputs: tuple[Tensor, ...],
    target: Tensor,
    device: torch.device,
    repeats: int,
) -> tuple[float, int]:
    """Stage j's (median seconds of a step's forwards and backwards, peak bytes of a step)."""
    stage = prog.module.to(device)
    run = Recompute(stage) if plan.stages[j].recompute else stage
    params = list(dict.fromkeys(stage.parameters()))
    optimizer = make_optimizer(plan.optimizer, params, 1e-4)
    m, last = plan.microbatches, j == plan.n_stages - 1
    if j == 0:
        feeds = [tuple(t.to(device) for t in inputs) for _ in range(m)]
    else:
        feeds = [tuple(_stand_in(x, device, True) for x in prog.example_inputs) for _ in range(m)]
    # one received gradient at a time, as a rank's receive buffer: the same stand-in for each
    grad = tuple(_stand_in(y, device, False) for y in prog.example_outputs)
    goal = target.to(device)
    order = action_order(plan.schedule, plan.n_stages, 1, m)[j]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        outs: dict[int, Any] = {}
        _sync(device)
        t0 = time.perf_counter()
        for op, _, i in order:
            if op == "F":
                outs[i] = run(*feeds[i])
            elif last:
                spec.loss(stage.rebuild_output(outs.pop(i)), goal).backward()
            else:
                torch.autograd.backward(list(outs.pop(i)), list(grad))
        _sync(device)
        busy = time.perf_counter() - t0
        optimizer.step()
        return busy

    step()  # warm-up: kernels chosen, the optimizer's state created
    busy = statistics.median(step() for _ in range(repeats))
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return busy, int(torch.cuda.max_memory_allocated(device))
    state = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, Tensor)]
    grads_now = [q.grad for q in params]
    tracker = TensorPeak()
    with tracker.track(live=live_bytes([*params, *grads_now, *state])):
        step()
    return busy, int(tracker.peak_bytes or 0)
