"""The schedule engine's cost for ``pipeplan calibrate``: o per operation, contention k, c.

The ranks run a real pipeline through :class:`pipeplan.runtime.engine.PipelineRunner` whose stages
compute (two linear layers of width w on micro-batches of 32 samples) at each m in
``ENGINE_MS`` (2 and 16 by default), interleaved over rounds, for each width w in ``widths``
(256, 512, 1024 and 1536 by default, so that one stage's forward + backward ranges from about
0.5 to 17 ms here, the range of the bundled models' stages; :func:`engine_step_times`).  In the
steady state both stages compute at once, and each extra micro-batch adds one steady-state
stage time

    slope = (1 + k) (F + B + 2 o) + C                  (the cost model's s_j)

with F + B the stage's forward and backward timed alone on rank 0 (as the profiler would) at
the start of every round, C the link's round trip of the stage's activations (from the link
fit, :mod:`pipeplan.runtime.linkbench`), o the engine's fixed cost per operation and k the contention
(:mod:`pipeplan.planner.costmodel`).  The slope is a Theil-Sen fit over the rounds' medians
(:func:`slope_per_microbatch`); a least-squares line of slope - C against F + B over the widths
gives 1 + k (its slope) and 2 (1 + k) o (its intercept) (:func:`fit_engine`).  With one width
k is taken as 0 (:func:`engine_overhead`).  The stages must compute: with ranks on every core,
the transport's threads wait for a core while the ranks compute, and that delay, which an idle
pipeline does not show, grows with the length of the operations
(``benchmarks/accuracy/engine_sweep.py``).  On CUDA devices that share nothing k comes out
near 0.

:func:`pipeplan.runtime.calibrate.calibrate` fits one line through the points of all its launches
(one per width and launch).  Over the 220 draws of 3 launches out of 12 measured here,
subsampled to today's defaults, k spread 0.107-0.283 that way (5th to 95th percentile),
0.091-0.328 through the widths' median points, and 0.089-0.307 as the median of each launch's
own fit; the charge for a 10 ms stage 13.1-14.1, 13.0-14.5 and 13.0-14.3 ms
(``benchmarks/calibrate``).  Earlier, with F + B timed once per launch, the median of the
launches' fits had been the steadier (``benchmarks/accuracy`` README); F + B is now timed
beside the steps, every round.

A 1-stage plan runs the same engine with no peer: no transfers, and no transport threads
competing with the compute for the cores.  Its o (``Cluster.solo_op_overhead_s``) comes from
1-rank launches of the same pipeline, step = c + m (F + B + 2 o) with the update's span taken
out, and so does the engine's fixed cost per step c (``Cluster.step_overhead_s``, charged to
every plan: every rank pays it at once) (:func:`solo_overhead`).

torch is imported inside the functions that run on the ranks, so the fits import no torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Cut, CutTensor

__all__ = [
    "ENGINE_MS",
    "LAYERS",
    "MICRO",
    "WIDTH",
    "WIDTHS",
    "engine_overhead",
    "engine_step_times",
    "fit_engine",
    "slope_per_microbatch",
    "solo_overhead",
]


#: Micro-batch counts of the engine measurement, run interleaved over rounds.  Two counts far
#: apart give the slope most precisely for the steps run (its error falls with their distance,
#: its cost grows with their sum); m = 2 and 16 at 3 steps each cost what m = 2, 4, 8 at 4 did
#: (``benchmarks/calibrate``).
ENGINE_MS = (2, 16)
#: The calibration stage: width, layers per stage, micro-batch size.
WIDTH, LAYERS, MICRO = 512, 2, 32
#: Widths of the calibration stages whose engine cost ``calibrate`` fits (o, k) to.
WIDTHS = (256, 512, 1024, 1536)


def _stage_module(width: int = WIDTH) -> Any:
    from torch import nn

    return nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])


def _calibration_plan(world: int, m: int, width: int = WIDTH) -> tuple[Any, Any]:
    """A plan of ``world`` identical stages and m micro-batches of MICRO samples, and its model."""
    import torch
    from torch import nn

    from pipeplan.intake.graph import group_units
    from pipeplan.intake.model import ModelSpec
    from pipeplan.intake.trace import trace_model
    from pipeplan.planner.evaluate import evaluate
    from pipeplan.planner.types import Cluster, DeviceInfo, PlanOptions, Profile, Timing, Unit

    torch.manual_seed(0)
    module = nn.Sequential(*[_stage_module(width) for _ in range(world)])
    spec = ModelSpec(
        module,
        lambda b: (torch.randn(b, width), torch.zeros(b, width)),
        nn.functional.mse_loss,
    )
    traced = trace_model(module, (torch.ones(1, width),), "fx")
    units = group_units(traced, "auto")
    zero = Timing(forward_s=0.0, backward_s=0.0, saved_bytes=0, output_bytes=0)
    row = 4 * width
    profile = Profile(
        model="calibration", tracer="fx", graph_fingerprint=traced.fingerprint,
        device=DeviceInfo(kind="cpu", name="calibration"), torch_version=torch.__version__,
        dtype="float32", batch_size=m * MICRO, microbatch_sizes=(MICRO,),
        input_bytes_per_sample=row,
        units=tuple(Unit(index=k, name=u.name, nodes=u.nodes, param_bytes=0,
                         timings={MICRO: zero}) for k, u in enumerate(units)),
        cuts=tuple(Cut(after=k, tensors=(CutTensor(node="x", bytes_per_sample=row),),
                       bytes_per_sample=row) for k in range(len(units) - 1)),
    )  # fmt: skip
    per_stage = len(units) // world
    cuts = [per_stage * j for j in range(1, world)]
    options = PlanOptions(microbatches=m, checkpoint="never")
    plan = evaluate(
        profile, Cluster.homogeneous(world, 2**40), options, cuts, m, solver="calibration"
    )
    return plan, spec


def _stage_times(repeats: int, width: int = WIDTH, input_grad: bool = True) -> list[float]:
    """Forward + backward seconds of one calibration stage alone, ``repeats`` times after 3
    warm-up passes.

    ``input_grad``: the backward also computes the gradient of the stage's input, as every
    stage but the first does (the pipeline's bottleneck when stages are alike); a 1-rank
    pipeline's only stage does not, and its backward is a third shorter."""
    import torch

    stage = _stage_module(width)
    x = torch.randn(MICRO, width, requires_grad=input_grad)
    grad = torch.randn(MICRO, width)
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        stage(x).backward(grad)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def engine_step_times(
    device: Any,
    repeats: int,
    rounds: int = 3,
    width: int = WIDTH,
    input_grad: bool = True,
    ms: Sequence[int] = ENGINE_MS,
    raw: dict[str, Any] | None = None,
    passes: int | None = None,
) -> tuple[dict[int, list[float]], float]:
    """Per round, the median of ``repeats`` step times of the calibration pipeline at each m in
    ``ms`` (after 2 untimed steps in the first round, 1 in later ones), less the step's
    optimizer update (its own span: the cost model charges updates separately); and the
    stage's forward + backward timed alone on rank 0 (:func:`_stage_times`, ``passes`` times,
    default ``repeats``; their median) at the start of every round, the median over rounds (0
    on other ranks).  Timing F + B beside the steps it is compared with, not once before them,
    keeps a slow phase of the host from landing on one and not the other.

    ``raw``, if given, receives every timing: ``{"steps": {m: [[step seconds] per round]},
    "compute": [[F + B seconds] per round]}`` (what ``benchmarks/calibrate`` subsamples)."""
    import torch.distributed as dist

    from pipeplan.runtime.engine import PipelineRunner

    runners = {}
    for m in ms:
        plan, spec = _calibration_plan(dist.get_world_size(), m, width)
        runners[m] = (PipelineRunner(plan, spec, device=device), spec.batch(m * MICRO))
    out: dict[int, list[float]] = {m: [] for m in ms}
    compute: list[float] = []
    kept: dict[str, Any] = raw if raw is not None else {}
    kept.update(steps={m: [] for m in ms}, compute=[])
    for r in range(rounds):
        dist.barrier()
        if dist.get_rank() == 0:  # the others wait at the barrier: rank 0 computes alone
            kept["compute"].append(_stage_times(passes or repeats, width, input_grad))
            compute.append(statistics.median(kept["compute"][-1]))
        dist.barrier()
        for m, (runner, batch) in runners.items():
            times: list[float] = []
            warm = 2 if r == 0 else 1  # later rounds find the runner built and run
            for step in range(repeats + warm):
                inputs, target = batch
                wall, spans, _ = runner.timed_step(inputs, target, step)
                if step >= warm:
                    times.append(wall - sum(s.duration_s for s in spans if s.kind == "optimizer"))
            out[m].append(statistics.median(times))
            kept["steps"][m].append(times)
            dist.barrier()
    return out, statistics.median(compute) if compute else 0.0


def slope_per_microbatch(step_times: dict[int, list[float]]) -> float:
    """Theil-Sen slope of step time against m: the median of the slopes between every pair of
    (m, round median) points with different m, robust to a round that landed in a slow phase.

    >>> round(slope_per_microbatch({2: [0.010, 0.010, 0.010], 16: [0.066, 0.066, 0.5]}), 6)
    0.004
    """
    points = [(m, t) for m, ts in step_times.items() for t in ts]
    slopes = [
        (t2 - t1) / (m2 - m1) for i, (m1, t1) in enumerate(points) for m2, t2 in points[i + 1 :]
        if m2 != m1
    ]  # fmt: skip
    return statistics.median(slopes)


def engine_overhead(
    step_times: dict[int, list[float]], round_trip_s: float, compute_s: float = 0.0
) -> float:
    """o from one width's step times when contention is taken as 0: (slope - F - B - C) / 2.

    >>> round(engine_overhead({2: [0.010], 16: [0.066]}, 0.0002, 0.002) * 1e3, 3)
    0.9
    """
    slope = slope_per_microbatch(step_times)
    return max((slope - compute_s - round_trip_s) / 2, 0.0)


def fit_engine(
    points: Sequence[tuple[float, float]], widths: Sequence[int] | None = None
) -> tuple[float, float]:
    """(o, k) from (F + B, slope - C) points of the calibration stages at several widths.

    The least-squares line y = a + b x gives k = b - 1 and o = a / (2 (1 + k)), each clamped
    at 0; with one distinct F + B, or every point at one width (``widths``, one per point:
    launches time the same width's F + B a little differently, and a line through those points
    is noise), k = 0 and o = median(y - x) / 2.

    >>> o, k = fit_engine([(0.001, 1.5 * (0.001 + 2e-4)), (0.007, 1.5 * (0.007 + 2e-4))])
    >>> round(o * 1e3, 6), round(k, 6)
    (0.1, 0.5)
    """
    if not points:
        raise InvalidRequestError("the engine fit needs at least one width")
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if np.ptp(x) <= 0 or (widths is not None and len(set(widths)) < 2):
        return max(float(np.median(y - x)) / 2, 0.0), 0.0
    b, a = np.polyfit(x, y, 1)
    kappa = max(float(b) - 1.0, 0.0)
    if kappa == 0.0:
        return max(float(np.mean(y - x)) / 2, 0.0), 0.0
    return max(float(a) / (2 * (1 + kappa)), 0.0), kappa


def solo_overhead(launches: Sequence[Sequence[dict[str, Any]]]) -> tuple[float, float]:
    """(o, c) of a 1-rank pipeline, whose step is c + m (F + B + 2 o) (no transfers, nothing
    beside it to contend with, the update left out): per width, the median over launches of
    (slope - F - B) / 2 and of the intercept (the median of t - slope m over the points); then
    the medians over widths.  c is the engine's fixed cost per step: zeroing gradients,
    splitting the batch, setting up the schedule, collecting the loss.

    >>> e = {"width": 256, "compute": 0.002, "steps": {"2": [0.0060], "16": [0.0396]}}
    >>> o, c = solo_overhead([[e], [e]])
    >>> round(o * 1e6), round(c * 1e6)
    (200, 1200)
    """
    per_o, per_c = [], []
    for runs in zip(*launches):
        os_, cs = [], []
        for e in runs:
            steps = {int(m): [float(x) for x in v] for m, v in e["steps"].items()}
            slope = slope_per_microbatch(steps)
            os_.append(engine_overhead(steps, 0.0, float(e["compute"])))
            cs.append(statistics.median(t - slope * m for m, ts in steps.items() for t in ts))
        per_o.append(statistics.median(os_))
        per_c.append(max(statistics.median(cs), 0.0))
    return float(statistics.median(per_o)), float(statistics.median(per_c))
