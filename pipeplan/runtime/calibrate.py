"""``pipeplan calibrate``: measure the link between pipeline ranks and describe the cluster.

One torchrun job of ``nproc`` ranks (:func:`measure`, each rank :func:`_worker`) measures, in
order, each with a module of its own that states what it times and the formulas it fits:

1. the link: ranks 0 and 1 play ping-pong (raw ``send``/``recv`` and the ``batch_isend_irecv``
   path of ``torch.distributed.pipelining``) from 4 bytes to ``max_bytes``, and all ranks time
   the runtime's tied-gradient all-reduce at the same sizes (:mod:`pipeplan.runtime.linkbench`);
2. the optimizer-update contention kappa_u: Adam steps on ranks 0 and 1 alone and at once
   (:mod:`pipeplan.runtime.update_contention`);
3. the host cost of tensor parallelism per split projection o_tp: pairs of ranks time an MLP
   whole and split with torch's ``parallelize_module``, and of sequence parallelism per
   collective o_sp, a pre-norm block split without and with it
   (:mod:`pipeplan.runtime.tp_overhead`; an even number of ranks);
4. the schedule engine: a real :class:`pipeplan.runtime.engine.PipelineRunner` pipeline of computing
   stages at several widths and micro-batch counts, whose steady-state slope gives the engine's
   cost per operation o and the contention k (:mod:`pipeplan.runtime.engine_fit`).

A 1-rank launch measures the engine alone (no link, no update contention).  ``nproc = 1``
describes one device: only 1-rank launches, whose engine figures are what 1-stage plans are
charged (a GPU machine with one GPU calibrates this way; its process group is still nccl).

:func:`calibrate` runs ``launches`` of them and keeps, per message size, the median of the
launches' one-way times (the link and all-reduce fits:
:func:`pipeplan.runtime.linkbench.fit_link`), fits one (o, k) line through every launch's
(stage time, slope) points (:func:`pipeplan.runtime.engine_fit.fit_engine`), and keeps the
median kappa_u; ``solo_launches`` 1-rank launches then give the engine's o and per-step cost c
for 1-stage plans (:func:`pipeplan.runtime.engine_fit.solo_overhead`).
The result is a :class:`~pipeplan.planner.types.Cluster` with one device per rank (memory: the GPU's,
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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeplan.planner.collectives import COLLECTIVES, Collective
from pipeplan.planner.errors import InvalidRequestError, StageFailedError
from pipeplan.planner.host import free_port
from pipeplan.planner.types import Cluster, Device, Link
from pipeplan.report.progress import progress_bar
from pipeplan.runtime.engine_fit import (
    ENGINE_MS,
    MICRO,
    WIDTHS,
    engine_step_times,
    fit_engine,
    slope_per_microbatch,
    solo_overhead,
)
from pipeplan.runtime.launch import watch
from pipeplan.runtime.linkbench import (
    fit_affine,
    fit_link,
    message_sizes,
    ring_link,
    time_allreduce,
    time_collectives,
    time_pingpong,
)
from pipeplan.runtime.tp_overhead import measure_tp_overhead, sequence_overhead, tp_overhead
from pipeplan.runtime.update_contention import measure_update_contention

__all__ = [
    "ENGINE_REPEATS",
    "SOLO_MS",
    "SOLO_WIDTHS",
    "calibrate",
    "combine",
    "combine_alone",
    "engine_points",
    "measure",
    "phases",
]

ENGINE_REPEATS = 3
"""Steps per micro-batch count and round of the engine measurement on the ranks, by default.
The stage's forward + backward alone is timed ``repeats`` times per round (20 by default): the
fit's x axis, cheap beside the pipeline steps, and the figure that moved (o, k) most when it was
timed only 4 times (``benchmarks/calibrate/subsample.py``)."""

SOLO_WIDTHS, SOLO_MS = (256, 512), (2, 4, 8, 16)
"""The 1-rank launches' widths and micro-batch counts.  Alone, the engine's o is the small
difference (slope - F - B) / 2 (:func:`~pipeplan.runtime.engine_fit.solo_overhead`), which a
short stage measures far more precisely than a long one (F + B = 0.5 and 2 ms here, against
8.5 and 19 ms at widths 1024 and 1536), and a short stage is cheap to run ``repeats`` times."""


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
    ap.add_argument("--engine-repeats", type=int, default=ENGINE_REPEATS)
    ap.add_argument("--ms", type=int, nargs="+", default=list(ENGINE_MS))
    ap.add_argument("--progress", default=None, help="rank 0 appends a line per phase done")
    args = ap.parse_args(argv)
    from pipeplan.planner.allocator import keep_heap
    from pipeplan.runtime.worker import default_threads

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

        def done(phase: str) -> None:
            if rank == 0 and args.progress:
                with open(args.progress, "a") as fh:
                    fh.write(phase + "\n")

        samples: list[tuple[int, float, float]] = []
        allreduce: list[tuple[int, float]] = []
        collectives: dict[str, list[tuple[int, float]]] = {}
        kappa_u = 0.0
        tp: dict[str, float] = {}
        if world > 1:  # a 1-rank launch measures the engine alone
            if rank < 2:  # ranks beyond the pair wait at the barrier
                samples = time_pingpong(message_sizes(args.max_bytes), args.repeats, device)
            dist.barrier()
            done("link")
            allreduce = time_allreduce(message_sizes(args.max_bytes), args.repeats, device)
            collectives = time_collectives(message_sizes(args.max_bytes), args.repeats, device)
            done("all-reduce")
            kappa_u = measure_update_contention(args.repeats, device)
            done("update contention")
            tp = measure_tp_overhead(device, args.repeats)
            done("tensor parallel")
        engine = []
        for width in args.widths:
            raw: dict[str, Any] = {}
            steps, compute = engine_step_times(
                torch.device(device), args.engine_repeats, width=width, input_grad=world > 1,
                ms=args.ms, raw=raw, passes=args.repeats,
            )  # fmt: skip
            engine.append({"width": width, "compute": compute, "steps": steps, "raw": raw})
            done(f"engine width {width}")
        if rank == 0:
            if args.device == "cuda":
                memory = torch.cuda.get_device_properties(local).total_memory
            else:
                memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                memory //= dist.get_world_size()
            with open(args.out + ".part", "w") as fh:
                json.dump(
                    {"samples": samples, "allreduce": allreduce, "collectives": collectives,
                     "memory": memory,
                     "engine": engine, "update_contention": kappa_u, "tensor_parallel": tp},
                    fh,
                )  # fmt: skip
            os.replace(args.out + ".part", args.out)  # whole or absent: measure() reads it
    finally:
        dist.destroy_process_group()


def phases(nproc: int, widths: Sequence[int]) -> int:
    """How many phases one launch of ``nproc`` ranks reports (:func:`measure`'s ``on_phase``):
    the link, the all-reduce, the update contention and tensor parallelism on 2+ ranks, then
    one per width."""
    return (4 if nproc > 1 else 0) + len(widths)


def measure(
    nproc: int,
    device: str,
    max_bytes: int,
    repeats: int,
    threads: int | None,
    timeout_s: float,
    widths: Sequence[int] = WIDTHS,
    on_phase: Callable[[str], None] | None = None,
    engine_repeats: int = 0,
    ms: Sequence[int] = ENGINE_MS,
) -> dict[str, Any]:
    """One torchrun job of ``nproc`` calibration ranks (one rank runs without the launcher);
    rank 0's raw measurements.

    Returns ``{"samples": [[bytes, raw_s, p2p_s], ...], "allreduce": [[bytes, s], ...],
    "memory": bytes, "engine": [{"width":
    w, "compute": F + B seconds, "steps": {m: [round median step seconds, ...]}, "raw": every
    timing (:func:`~pipeplan.runtime.engine_fit.engine_step_times`)}, ...],
    "update_contention": kappa_u}``, one engine entry per width in order (kappa_u 0 on a 1-rank
    launch); :func:`calibrate` combines several of these.  ``repeats`` round trips per message
    size, Adam steps and passes of a calibration stage's forward + backward alone;
    ``engine_repeats`` (default ``repeats``) steps per m in ``ms`` and round of the engine
    measurement.  ``on_phase`` is called with each phase's name as rank 0
    finishes it (:func:`phases` of them).
    """
    with tempfile.TemporaryDirectory(prefix="pipeplan-calibrate-") as tmp:
        out, progress = os.path.join(tmp, "result.json"), os.path.join(tmp, "progress")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if nproc > 1:
            launcher = [
                "-m", "pipeplan.runtime.forkrun", "--standalone", f"--nproc-per-node={nproc}"
            ]  # fmt: skip
        else:  # one rank needs no launcher (whose own torch import costs seconds here)
            launcher = []
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
        cmd = [
            sys.executable, *launcher, "-m", "pipeplan.runtime.calibrate",
            "--out", out, "--max-bytes", str(max_bytes), "--repeats", str(repeats),
            "--device", device, "--widths", *map(str, widths), "--progress", progress,
            "--engine-repeats", str(engine_repeats or repeats), "--ms", *map(str, ms),
            *(["--threads", str(threads)] if threads else []),
        ]  # fmt: skip
        with open(os.path.join(tmp, "stderr"), "w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env)
            seen = 0

            def poll() -> None:
                nonlocal seen
                if on_phase is not None and os.path.exists(progress):
                    with open(progress) as fh:
                        lines = fh.read().splitlines()
                    for line in lines[seen:]:
                        on_phase(line)
                    seen = len(lines)

            code = watch(proc, poll, timeout_s)
            if code is None:
                raise StageFailedError(f"calibration did not finish in {timeout_s:.0f} s")
            err.seek(0)
            stderr = err.read()
        # rank 0 writes its result whole after the last measurement; a rank that fails after
        # it (gloo's teardown can abort one: "terminate called without an active exception",
        # seen rarely here) loses nothing
        if not os.path.exists(out):
            tail = (stderr.strip().splitlines() or ["no output"])[-1]
            raise StageFailedError(f"calibration ranks failed (exit {code}): {tail}")
        with open(out) as fh:
            result: dict[str, Any] = json.load(fh)
    return result


def calibrate(
    nproc: int = 2,
    *,
    device: str = "cpu",
    max_bytes: int = 16 * 2**20,
    repeats: int = 20,
    engine_repeats: int = ENGINE_REPEATS,
    launches: int = 3,
    solo_launches: int = 2,
    widths: Sequence[int] = WIDTHS,
    memory_bytes: int | None = None,
    threads: int | None = None,
    timeout_s: float = 300.0,
    progress: bool = False,
) -> tuple[Cluster, list[tuple[int, float, float]]]:
    """Launch ``nproc`` ranks with torchrun ``launches`` times, measure, and return the cluster
    and the link samples.

    Every launch measures the link and the engine; the cluster takes, per message size, the
    median of the launches' one-way times; :func:`fit_engine` fits the engine cost o and the
    contention k through every launch's (stage time, slope) points, one per width and launch;
    and the cluster takes the median of the launches' update contention kappa_u.  On a shared
    host one launch can land in a slow or a fast phase (engine costs of 0.49 and 0.90-0.99 ms
    per operation were measured by single launches minutes apart), so one launch is not enough.
    ``solo_launches`` 1-rank launches then measure the engine alone for
    1-stage plans (:func:`solo_overhead`); 0 skips them.  ``progress`` shows a bar (rich, on
    stderr) that advances as each launch's rank 0 finishes a phase.
    """
    if nproc < 1:
        raise InvalidRequestError(f"--nproc {nproc}: calibrate at least 1 rank")
    if device not in ("cpu", "cuda"):
        raise InvalidRequestError(f"--device {device!r} is not cpu or cuda")
    if repeats < 1:
        raise InvalidRequestError(f"--repeats {repeats} must be at least 1")
    if engine_repeats < 1:
        raise InvalidRequestError(f"--engine-repeats {engine_repeats} must be at least 1")
    if solo_launches < 0:
        raise InvalidRequestError(f"--solo-launches {solo_launches} must be 0 or more")
    if launches < 1:
        raise InvalidRequestError(f"--launches {launches} must be at least 1")
    if not widths or min(widths) < 1:
        raise InvalidRequestError(f"--widths {list(widths)}: give one or more positive widths")
    if nproc == 1:  # one device: its launches are the 1-rank ones, at least one
        launches, solo_launches = 0, max(solo_launches, 1)
        solo_widths = SOLO_WIDTHS if tuple(widths) == WIDTHS else tuple(widths)
    else:
        solo_widths = SOLO_WIDTHS
    # (ranks, name, widths, engine repeats, micro-batch counts) of each launch
    jobs = [
        (nproc, f"launch {i + 1}/{launches}", tuple(widths), engine_repeats, ENGINE_MS)
        for i in range(launches)
    ] + [
        (1, f"1 rank alone {i + 1}/{solo_launches}", solo_widths, repeats, SOLO_MS)
        for i in range(solo_launches)
    ]
    runs: list[dict[str, Any]] = []
    with progress_bar(progress) as bar:
        task = bar.add_task("calibrate", total=sum(phases(j[0], j[2]) for j in jobs))
        for n, name, w, reps, ms in jobs:
            bar.update(task, description=f"{name}: {'link' if n > 1 else 'engine'}")

            def on_phase(phase: str, name: str = name) -> None:
                bar.update(task, advance=1, description=f"{name}: {phase} done")

            runs.append(
                measure(n, device, max_bytes, repeats, threads, timeout_s, w, on_phase, reps, ms)
            )
    if nproc == 1:
        return combine_alone(runs, device=device, memory_bytes=memory_bytes), []
    return combine(
        nproc, runs[:launches], runs[launches:], widths=widths, device=device,
        memory_bytes=memory_bytes,
    )  # fmt: skip


def engine_points(
    result: dict[str, Any], link: Link, widths: Sequence[int] = WIDTHS
) -> list[tuple[float, float]]:
    """One launch's (F + B, slope - C) engine points, one per width in order: C is the round
    trip of the stage's activations over ``link`` (:func:`fit_engine` fits its line)."""
    points = []
    for width, e in zip(widths, result["engine"], strict=True):
        steps = {int(m): [float(x) for x in v] for m, v in e["steps"].items()}
        round_trip = 2 * link.transfer_s(4 * width * MICRO)  # the stage's activations
        points.append((float(e["compute"]), slope_per_microbatch(steps) - round_trip))
    return points


def combine(
    nproc: int,
    results: Sequence[dict[str, Any]],
    alone: Sequence[dict[str, Any]],
    *,
    widths: Sequence[int] = WIDTHS,
    device: str = "cpu",
    memory_bytes: int | None = None,
) -> tuple[Cluster, list[tuple[int, float, float]]]:
    """The cluster that launches' raw measurements describe (:func:`measure`'s results): of
    ``nproc``-rank launches ``results`` and 1-rank launches ``alone`` (none: no 1-stage engine
    figures), as :func:`calibrate` takes their medians; and the link samples.  One launch of
    each gives that launch's own figures."""
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
    # one line through the points of every launch at every width
    points = [pt for r in results for pt in engine_points(r, link, widths)]
    overhead, kappa = fit_engine(points, [w for _ in results for w in widths])
    kappa_u = statistics.median(float(r.get("update_contention", 0.0)) for r in results)
    tp_op = statistics.median(tp_overhead(r.get("tensor_parallel", {}), link) for r in results)
    tp_seq = statistics.median(
        sequence_overhead(r.get("tensor_parallel", {}), link) for r in results
    )
    solo = step_cost = None
    if alone:
        solo, step_cost = solo_overhead([r["engine"] for r in alone])
    memory = memory_bytes if memory_bytes is not None else int(results[0]["memory"])
    kind = "gpu" if device == "cuda" else "cpu"
    devices = tuple(Device(name=f"{kind}{j}", memory_bytes=memory) for j in range(nproc))
    replica = ring_link(allreduce, nproc) if nproc > 1 else None
    # FSDP2's collectives and the replicas' all-reduce, each an affine fit of the medians at
    # every size over the launches (pipeplan.planner.collectives rescales them to d ranks)
    collectives: dict[Collective, tuple[float, float]] = {}
    for kind in COLLECTIVES if nproc > 1 else ():
        per_launch = [_points(r, kind) for r in results]
        if all(per_launch):
            medians = [
                (int(pts[0][0]), float(np.median([pt[1] for pt in pts])))
                for pts in zip(*per_launch)
            ]
            if len(medians) > 1:
                collectives[kind] = fit_affine(medians)
    cluster = Cluster(
        devices=devices, link=link, allreduce=allreduce, replica_link=replica,
        collectives=collectives, collective_ranks=max(nproc, 2), op_overhead_s=overhead,
        solo_op_overhead_s=solo, step_overhead_s=step_cost or 0.0, contention=kappa,
        update_contention=kappa_u, tp_op_overhead_s=tp_op, tp_sequence_overhead_s=tp_seq,
    )  # fmt: skip
    return cluster, samples  # type: ignore[return-value]


def _points(result: dict[str, Any], kind: str) -> list[Any]:
    """One launch's (bytes, seconds) of a collective (``all_reduce``: the runtime's gradient
    sum, also the tied parameters'); empty where it was not measured."""
    if kind == "all_reduce":
        return list(result.get("allreduce", []))
    return list(result.get("collectives", {}).get(kind, []))


def combine_alone(
    alone: Sequence[dict[str, Any]], *, device: str = "cpu", memory_bytes: int | None = None
) -> Cluster:
    """The one-device cluster that 1-rank launches describe: the engine's cost per operation
    o (also as ``op_overhead_s``: a 1-stage plan is all this cluster runs) and per step c
    (:func:`solo_overhead`); no link, all-reduce or contention to measure.

    >>> e = {"width": 256, "compute": 0.002, "steps": {"2": [0.0060], "16": [0.0396]}}
    >>> c = combine_alone([{"engine": [e], "memory": 2**30}], device="cuda")
    >>> c.n_stages, c.devices[0].name, round(c.solo_op_overhead_s * 1e6), round(c.step_overhead_s * 1e6)
    (1, 'gpu0', 200, 1200)
    """
    solo, step_cost = solo_overhead([r["engine"] for r in alone])
    memory = memory_bytes if memory_bytes is not None else int(alone[0]["memory"])
    kind = "gpu" if device == "cuda" else "cpu"
    return Cluster(
        devices=(Device(name=f"{kind}0", memory_bytes=memory),),
        op_overhead_s=solo,
        solo_op_overhead_s=solo,
        step_overhead_s=step_cost,
    )


if __name__ == "__main__":
    _worker()
