"""``pipeplan calibrate``: measure the link between pipeline ranks and describe the cluster.

Ranks 0 and 1 of a torchrun job play ping-pong over ``torch.distributed`` (the backend the
runtime uses: gloo on CPU, nccl on CUDA) for message sizes from 4 bytes to ``max_bytes``:

* ``raw``: blocking ``send``/``recv``;
* ``p2p``: ``batch_isend_irecv`` + ``wait``, the path ``torch.distributed.pipelining`` takes.

Half the median round trip is the one-way time.  The latency is the median raw one-way time of
messages up to 4 KiB; the bandwidth is the least-squares fit of ``(time - latency) = size /
bandwidth`` over messages of 64 KiB and more; the median extra cost of the p2p path over the
raw one at small sizes is the per-message software ``overhead``.  The raw samples themselves go
into the link too: the cost model interpolates them, since a loopback or NIC transport changes
protocol with the message size and no single line fits all sizes.  Times are the 25th percentile of the repeats: the uncontended transfer.  (On a busy host a rank
is sometimes woken milliseconds late; that cost shows up in real steps and is left to the
engine's cost below, measured on real steps.)

All ranks then time the all-reduce the runtime runs for tied gradients (flatten, ``all_reduce``
over the ranks, copy back; ``runtime.engine``), after a barrier, at the same sizes; the
cluster's ``allreduce`` link is fitted to those times as the link is to the ping-pong's.

Then ranks 0 and 1 time an Adam step (:func:`planner.optim.make_optimizer`) over the same
parameters (``UPDATE_TENSORS`` tensors of ``UPDATE_BYTES`` of float32 in all, fresh random
gradients each time) in three modes, interleaved over ``repeats`` rounds, each after a barrier:
rank 0 alone (the others wait at the next barrier), rank 1 alone, both at once.  Before every
timed step each rank writes through a 64 MiB buffer, so the cache is as cold as after a
backward (on CUDA the step is timed between synchronisations, with no flush).  Updates that
run at once slow each other by egalitarian processor sharing (:mod:`planner.costmodel`): two of
the same length that start together both take (1 + kappa_u) times as long, so

    kappa_u = median(both) / median(alone) - 1            (:func:`update_contention`)

per rank; the launch keeps the mean over ranks 0 and 1, clamped at 0
(``Cluster.update_contention``).

Then the ranks run a real pipeline through :class:`runtime.engine.PipelineRunner` whose stages
compute (two linear layers of width w on micro-batches of 32 samples) at m = 2, 4, 8 and 16,
interleaved over rounds, for each width w in ``widths`` (256, 512, 1024 and 1536 by default, so
that one stage's forward + backward ranges from about 0.5 to 17 ms here, the range of the
bundled models' stages).  In the steady state both
stages compute at once, and each extra micro-batch adds one steady-state stage time

    slope = (1 + k) (F + B + 2 o) + C                  (the cost model's s_j)

with F + B the stage's forward and backward timed alone on rank 0 (as the profiler would) at
the start of every round, C
the link's round trip of the stage's activations (from the fit above), o the engine's fixed
cost per operation and k the contention (:mod:`planner.costmodel`).  The slope is a Theil-Sen
fit over the rounds' medians; a least-squares line of slope - C against F + B over the widths
gives 1 + k (its slope) and 2 (1 + k) o (its intercept).  With one width k is taken as 0.
The stages must compute: with ranks on every core, the transport's threads wait for a core
while the ranks compute, and that delay, which an idle pipeline does not show, grows with the
length of the operations (``benchmarks/accuracy/engine_sweep.py``).  On CUDA devices that
share nothing k comes out near 0.

Every launch measures both; :func:`calibrate` runs ``launches`` of them, fits (o, k) to each
launch's widths and keeps the median o and the median k.  One fit through the widths' median
points, as before, let one launch's slow phase at one width tilt the line: over 20 draws of 3
launches out of 6 measured here, k spread 0.25-0.52 that way and 0.31-0.41 as the median of
the launches' fits (F + B then timed once per launch; ``benchmarks/accuracy`` README).
A 1-stage plan runs the same engine with no peer: no transfers, and no transport threads
competing with the compute for the cores.  Its o (``Cluster.solo_op_overhead_s``) comes from
1-rank launches of the same pipeline, step = c + m (F + B + 2 o) with the update's span taken
out, and so does the engine's fixed cost per step c (``Cluster.step_overhead_s``, charged to
every plan: every rank pays it at once).
The result is a :class:`~planner.types.Cluster` with one device per rank (memory: the GPU's,
or this machine's RAM divided among the ranks) that ``pipeplan plan --cluster`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from planner.errors import InvalidRequestError, StageFailedError
from planner.types import Cluster, Cut, CutTensor, Device, Link

__all__ = [
    "WIDTHS",
    "calibrate",
    "engine_overhead",
    "fit_engine",
    "fit_link",
    "measure",
    "message_sizes",
    "slope_per_microbatch",
    "solo_overhead",
    "update_contention",
]


def message_sizes(max_bytes: int) -> list[int]:
    """4 B, then every power of four up to ``max_bytes``.

    >>> message_sizes(1024)
    [4, 16, 64, 256, 1024]
    """
    sizes, s = [], 4
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    return sizes


def fit_link(samples: Sequence[tuple[int, float, float]]) -> Link:
    """Link from (bytes, raw one-way s, p2p one-way s) samples (see module docstring)."""
    if len(samples) < 2:
        raise InvalidRequestError("calibration needs at least two message sizes; raise --max-size")
    size = np.array([s[0] for s in samples], dtype=np.float64)
    raw = np.array([s[1] for s in samples])
    p2p = np.array([s[2] for s in samples])
    small = size <= 4096
    latency = float(np.median(raw[small])) if small.any() else float(raw.min())
    # Bandwidth from the large messages: least squares of (t - latency) = size / bandwidth.
    large = size >= 65536
    if not large.any():
        large = size == size.max()
    excess = np.maximum(raw[large] - latency, 1e-12)
    bandwidth = float(np.sum(size[large] ** 2) / np.sum(size[large] * excess))
    overhead = float(np.median((p2p - raw)[small])) if small.any() else 0.0
    return Link(
        bandwidth_Bps=bandwidth,
        latency_s=latency,
        overhead_s=max(overhead, 0.0),
        samples=tuple((int(n), float(t)) for n, t in zip(size, raw)),
    )


def _low(samples: list[float]) -> float:
    """The 25th percentile: the uncontended time (a rank woken late is the engine's cost)."""
    return float(np.percentile(samples, 25))


def _pingpong(sizes: list[int], repeats: int, device: str) -> list[tuple[int, float, float]]:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    peer = 1 - rank
    out: list[tuple[int, float, float]] = []
    for size in sizes:
        buf = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=device)

        def raw(buf: Any = buf) -> None:
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        def p2p(buf: Any = buf) -> None:
            first, second = (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)
            for op in (first, second):
                for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
                    work.wait()

        times: dict[str, list[float]] = {"raw": [], "p2p": []}
        for i in range(repeats + 2):
            for name, fn in (("raw", raw), ("p2p", p2p)):
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if device != "cpu":
                    torch.cuda.synchronize()
                if i >= 2:  # warm-up
                    times[name].append((time.perf_counter() - t0) / 2)
        out.append((size, _low(times["raw"]), _low(times["p2p"])))
    return out


def _allreduce(sizes: list[int], repeats: int, device: str) -> list[tuple[int, float]]:
    """(bytes, seconds) of the runtime's tied-gradient sum on every rank, from a barrier."""
    import torch
    import torch.distributed as dist

    out: list[tuple[int, float]] = []
    for size in sizes:
        param = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=device)
        grad = torch.ones_like(param)
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            flat = torch.cat([grad.reshape(-1)])  # as runtime.engine's _sync_tied
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            param.grad = flat[: param.numel()].view_as(param).clone()
            if device != "cpu":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out.append((size, _low(times)))
    return out


#: The update-contention measurement: parameter tensors and their bytes in all (float32).
UPDATE_TENSORS, UPDATE_BYTES = 8, 8 * 2**20
#: Bytes written before every timed update, to evict the cache as a backward does.
FLUSH_BYTES = 64 * 2**20


def update_contention(alone: Sequence[float], both: Sequence[float]) -> float:
    """kappa_u of one rank: median(both) / median(alone) - 1, from its update's seconds alone
    and beside another rank's update of the same length (negative when the pair ran faster:
    the caller averages ranks, then clamps).

    >>> round(update_contention([0.010, 0.011, 0.009], [0.012, 0.013, 0.030]), 6)
    0.3
    """
    if not alone or not both:
        raise InvalidRequestError("the update contention needs times alone and together")
    return float(statistics.median(both) / statistics.median(alone) - 1.0)


def _update_times(repeats: int, device: str) -> tuple[list[float], list[float]]:
    """(alone, both): this rank's Adam step seconds alone and beside rank 1 - rank's, per round
    after two warm-up rounds (both empty on ranks >= 2, which only keep the barriers)."""
    import torch
    import torch.distributed as dist

    from planner.optim import make_optimizer

    rank = dist.get_rank()
    numel = UPDATE_BYTES // 4 // UPDATE_TENSORS
    params = [torch.randn(numel, device=device, requires_grad=True) for _ in range(UPDATE_TENSORS)]
    for param in params:
        param.grad = torch.randn_like(param)
    opt = make_optimizer("adam", params, 1e-3)
    cuda = device != "cpu"
    junk = None if cuda else torch.zeros(FLUSH_BYTES // 4)
    alone: list[float] = []
    both: list[float] = []
    for i in range(repeats + 2):
        for mode in (0, 1, 2):  # rank 0 alone, rank 1 alone, both at once
            runs = rank == mode or (mode == 2 and rank < 2)
            if runs:
                for param in params:
                    assert param.grad is not None
                    param.grad.normal_()
                if junk is not None:
                    junk.add_(1.0)  # evict the cache, as a backward does
                if cuda:
                    torch.cuda.synchronize()
            dist.barrier()
            if not runs:
                continue
            t0 = time.perf_counter()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:  # warm-up: the optimizer's state is allocated on the first step
                (both if mode == 2 else alone).append(time.perf_counter() - t0)
    dist.barrier()
    return alone, both


def _measure_update_contention(repeats: int, device: str) -> float:
    """kappa_u of this launch: the mean of ranks 0 and 1's :func:`update_contention`, >= 0."""
    import torch
    import torch.distributed as dist

    alone, both = _update_times(repeats, device)
    own = update_contention(alone, both) if alone else 0.0
    total = torch.tensor([own], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # ranks >= 2 add 0
    return max(float(total.item()) / 2, 0.0)


#: Micro-batch counts of the engine measurement, run interleaved over rounds.
ENGINE_MS = (2, 4, 8, 16)
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

    from planner.costmodel import evaluate
    from planner.graph import group_units
    from planner.model import ModelSpec
    from planner.trace import trace_model
    from planner.types import Cluster, DeviceInfo, PlanOptions, Profile, Timing, Unit

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


def _stage_compute_s(repeats: int, width: int = WIDTH, input_grad: bool = True) -> float:
    """Forward + backward seconds of one calibration stage alone (median).

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
    return statistics.median(times)


def _engine_step_times(
    device: Any, repeats: int, rounds: int = 3, width: int = WIDTH, input_grad: bool = True
) -> tuple[dict[int, list[float]], float]:
    """Per round, the median step time of the calibration pipeline at each m in ENGINE_MS, less
    the step's optimizer update (its own span: the cost model charges updates separately);
    and the stage's forward + backward timed alone on rank 0 (:func:`_stage_compute_s`) at the
    start of every round, the median over rounds (0 on other ranks).  Timing F + B beside the
    steps it is compared with, not once before them, keeps a slow phase of the host from
    landing on one and not the other."""
    import torch.distributed as dist

    from runtime.engine import PipelineRunner

    runners = {}
    for m in ENGINE_MS:
        plan, spec = _calibration_plan(dist.get_world_size(), m, width)
        runners[m] = (PipelineRunner(plan, spec, device=device), spec.batch(m * MICRO))
    out: dict[int, list[float]] = {m: [] for m in ENGINE_MS}
    compute: list[float] = []
    for _ in range(rounds):
        dist.barrier()
        if dist.get_rank() == 0:  # the others wait at the barrier: rank 0 computes alone
            compute.append(_stage_compute_s(repeats, width, input_grad))
        dist.barrier()
        for m, (runner, batch) in runners.items():
            walls = []
            for step in range(repeats + 2):
                inputs, target = batch
                wall, spans, _ = runner.timed_step(inputs, target, step)
                if step >= 2:
                    walls.append(wall - sum(s.duration_s for s in spans if s.kind == "optimizer"))
            out[m].append(statistics.median(walls))
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


def fit_engine(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(o, k) from (F + B, slope - C) points of the calibration stages at several widths.

    The least-squares line y = a + b x gives k = b - 1 and o = a / (2 (1 + k)), each clamped
    at 0; with one distinct F + B, k = 0 and o = (y - x) / 2.

    >>> o, k = fit_engine([(0.001, 1.5 * (0.001 + 2e-4)), (0.007, 1.5 * (0.007 + 2e-4))])
    >>> round(o * 1e3, 6), round(k, 6)
    (0.1, 0.5)
    """
    if not points:
        raise InvalidRequestError("the engine fit needs at least one width")
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if np.ptp(x) <= 0:
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


def _worker(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-bytes", type=int, required=True)
    ap.add_argument("--repeats", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    args = ap.parse_args(argv)
    from planner.allocator import keep_heap
    from runtime.worker import default_threads

    keep_heap()  # as the runtime's ranks run
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(
        args.threads or default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    )
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        samples: list[tuple[int, float, float]] = []
        allreduce: list[tuple[int, float]] = []
        kappa_u = 0.0
        if world > 1:  # a 1-rank launch measures the engine alone
            if rank < 2:  # ranks beyond the pair wait at the barrier
                samples = _pingpong(message_sizes(args.max_bytes), args.repeats, device)
            dist.barrier()
            allreduce = _allreduce(message_sizes(args.max_bytes), args.repeats, device)
            kappa_u = _measure_update_contention(args.repeats, device)
        engine = []
        for width in args.widths:
            steps, compute = _engine_step_times(
                torch.device(device), args.repeats, width=width, input_grad=world > 1
            )
            engine.append({"width": width, "compute": compute, "steps": steps})
        if rank == 0:
            if args.device == "cuda":
                memory = torch.cuda.get_device_properties(local).total_memory
            else:
                memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                memory //= dist.get_world_size()
            with open(args.out, "w") as fh:
                json.dump(
                    {"samples": samples, "allreduce": allreduce, "memory": memory,
                     "engine": engine, "update_contention": kappa_u},
                    fh,
                )  # fmt: skip
    finally:
        dist.destroy_process_group()


def measure(
    nproc: int,
    device: str,
    max_bytes: int,
    repeats: int,
    threads: int | None,
    timeout_s: float,
    widths: Sequence[int] = WIDTHS,
) -> dict[str, Any]:
    """One torchrun job of ``nproc`` calibration ranks; rank 0's raw measurements.

    Returns ``{"samples": [[bytes, raw_s, p2p_s], ...], "allreduce": [[bytes, s], ...],
    "memory": bytes, "engine": [{"width":
    w, "compute": F + B seconds, "steps": {m: [round median step seconds, ...]}}, ...],
    "update_contention": kappa_u}``, one engine entry per width in order (kappa_u 0 on a 1-rank
    launch); :func:`calibrate` combines several of these.
    """
    with tempfile.TemporaryDirectory(prefix="pipeplan-calibrate-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "runtime.calibrate",
            "--out", out, "--max-bytes", str(max_bytes), "--repeats", str(repeats),
            "--device", device, "--widths", *map(str, widths),
            *(["--threads", str(threads)] if threads else []),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            raise StageFailedError(f"calibration did not finish in {timeout_s:.0f} s") from None
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise StageFailedError(f"calibration ranks failed (exit {proc.returncode}): {tail}")
        with open(out) as fh:
            result: dict[str, Any] = json.load(fh)
    return result


def calibrate(
    nproc: int = 2,
    *,
    device: str = "cpu",
    max_bytes: int = 16 * 2**20,
    repeats: int = 20,
    launches: int = 3,
    solo_launches: int | None = None,
    widths: Sequence[int] = WIDTHS,
    memory_bytes: int | None = None,
    threads: int | None = None,
    timeout_s: float = 300.0,
) -> tuple[Cluster, list[tuple[int, float, float]]]:
    """Launch ``nproc`` ranks with torchrun ``launches`` times, measure, and return the cluster
    and the link samples.

    Every launch measures the link and the engine; the cluster takes, per message size, the
    median of the launches' one-way times; :func:`fit_engine` fits the engine cost o and the
    contention k to each launch's (stage time, slope) points over the widths, and the cluster
    takes the median o and the median k over launches, and the median of the launches' update
    contention kappa_u.  On a shared
    host one launch can land in a slow or a fast phase (engine costs of 0.49 and 0.90-0.99 ms
    per operation were measured by single launches minutes apart), so one launch is not enough.
    ``solo_launches`` (default ``launches``) 1-rank launches then measure the engine alone for
    1-stage plans (:func:`solo_overhead`); 0 skips them.
    """
    if solo_launches is None:
        solo_launches = launches
    if nproc < 2:
        raise InvalidRequestError(f"--nproc {nproc}: calibration needs at least 2 ranks")
    if device not in ("cpu", "cuda"):
        raise InvalidRequestError(f"--device {device!r} is not cpu or cuda")
    if repeats < 1:
        raise InvalidRequestError(f"--repeats {repeats} must be at least 1")
    if launches < 1:
        raise InvalidRequestError(f"--launches {launches} must be at least 1")
    if not widths or min(widths) < 1:
        raise InvalidRequestError(f"--widths {list(widths)}: give one or more positive widths")
    results = [
        measure(nproc, device, max_bytes, repeats, threads, timeout_s, widths)
        for _ in range(launches)
    ]
    samples = [
        (int(per_size[0][0]), *(float(np.median([s[k] for s in per_size])) for k in (1, 2)))
        for per_size in zip(*(r["samples"] for r in results))
    ]
    link = fit_link(samples)  # type: ignore[arg-type]
    allreduce = fit_link([
        (int(per_size[0][0]), t, t)
        for per_size in zip(*(r["allreduce"] for r in results))
        for t in [float(np.median([s[1] for s in per_size]))]
    ])  # fmt: skip
    fits = []
    for r in results:  # one (o, k) per launch, from its own widths' points
        points = []
        for width, e in zip(widths, r["engine"], strict=True):
            steps = {int(m): [float(x) for x in v] for m, v in e["steps"].items()}
            round_trip = 2 * link.transfer_s(4 * width * MICRO)  # the stage's activations
            points.append((float(e["compute"]), slope_per_microbatch(steps) - round_trip))
        fits.append(fit_engine(points))
    overhead = statistics.median(f[0] for f in fits)
    kappa = statistics.median(f[1] for f in fits)
    kappa_u = statistics.median(float(r.get("update_contention", 0.0)) for r in results)
    solo = step_cost = None
    if solo_launches:
        alone = [
            measure(1, device, max_bytes, repeats, threads, timeout_s, widths)
            for _ in range(solo_launches)
        ]
        solo, step_cost = solo_overhead([r["engine"] for r in alone])
    memory = memory_bytes if memory_bytes is not None else int(results[0]["memory"])
    kind = "gpu" if device == "cuda" else "cpu"
    devices = tuple(Device(name=f"{kind}{j}", memory_bytes=memory) for j in range(nproc))
    cluster = Cluster(
        devices=devices, link=link, allreduce=allreduce, op_overhead_s=overhead,
        solo_op_overhead_s=solo, step_overhead_s=step_cost or 0.0, contention=kappa,
        update_contention=kappa_u,
    )  # fmt: skip
    return cluster, samples  # type: ignore[return-value]


if __name__ == "__main__":
    _worker()
