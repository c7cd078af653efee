"""``pipeplan calibrate``: measure the link between pipeline ranks and describe the cluster.

One torchrun job of ``nproc`` ranks (:func:`measure`, each rank :func:`_worker`) measures, in
order, each with a module of its own that states what it times and the formulas it fits:

1. the link: ranks 0 and 1 play ping-pong (raw ``send``/``recv`` and the ``batch_isend_irecv``
   path of ``torch.distributed.pipelining``) from 4 bytes to ``max_bytes``, and all ranks time
   the runtime's tied-gradient all-reduce at the same sizes (:mod:`pipeplan.runtime.linkbench`);
2. the optimizer-update contention kappa_u: Adam steps on ranks 0 and 1 alone and at once
   (:mod:`pipeplan.runtime.update_contention`);
3. the schedule engine: a real :class:`pipeplan.runtime.engine.PipelineRunner` pipeline of computing
   stages at several widths and micro-batch counts, whose steady-state slope gives the engine's
   cost per operation o and the contention k (:mod:`pipeplan.runtime.engine_fit`).

A 1-rank launch measures the engine alone (no link, no update contention).

:func:`calibrate` runs ``launches`` of them and keeps, per message size, the median of the
launches' one-way times (the link and all-reduce fits: :func:`pipeplan.runtime.linkbench.fit_link`),
fits (o, k) to each launch's widths and keeps the median o and the median k
(:func:`pipeplan.runtime.engine_fit.fit_engine`), and the median kappa_u; ``solo_launches`` 1-rank
launches then give the engine's o and per-step cost c for 1-stage plans
(:func:`pipeplan.runtime.engine_fit.solo_overhead`).
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeplan.planner.errors import InvalidRequestError, StageFailedError
from pipeplan.planner.types import Cluster, Device
from pipeplan.runtime.engine_fit import (
    MICRO,
    WIDTHS,
    engine_step_times,
    fit_engine,
    slope_per_microbatch,
    solo_overhead,
)
from pipeplan.runtime.linkbench import (
    fit_link,
    message_sizes,
    ring_link,
    time_allreduce,
    time_pingpong,
)
from pipeplan.runtime.update_contention import measure_update_contention

__all__ = ["calibrate", "measure"]


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
        samples: list[tuple[int, float, float]] = []
        allreduce: list[tuple[int, float]] = []
        kappa_u = 0.0
        if world > 1:  # a 1-rank launch measures the engine alone
            if rank < 2:  # ranks beyond the pair wait at the barrier
                samples = time_pingpong(message_sizes(args.max_bytes), args.repeats, device)
            dist.barrier()
            allreduce = time_allreduce(message_sizes(args.max_bytes), args.repeats, device)
            kappa_u = measure_update_contention(args.repeats, device)
        engine = []
        for width in args.widths:
            steps, compute = engine_step_times(
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
            f"--nproc-per-node={nproc}", "-m", "pipeplan.runtime.calibrate",
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
    replica = ring_link(allreduce, nproc) if nproc > 1 else None
    cluster = Cluster(
        devices=devices, link=link, allreduce=allreduce, replica_link=replica,
        op_overhead_s=overhead,
        solo_op_overhead_s=solo, step_overhead_s=step_cost or 0.0, contention=kappa,
        update_contention=kappa_u,
    )  # fmt: skip
    return cluster, samples  # type: ignore[return-value]


if __name__ == "__main__":
    _worker()
