"""Link measurement for ``pipeplan calibrate``: ping-pong between ranks 0 and 1, the all-reduce.

Ranks 0 and 1 of a torchrun job play ping-pong over ``torch.distributed`` (the backend the
runtime uses: gloo on CPU, nccl on CUDA) for message sizes from 4 bytes to ``max_bytes``
(:func:`message_sizes`, :func:`time_pingpong`):

* ``raw``: blocking ``send``/``recv``;
* ``p2p``: ``batch_isend_irecv`` + ``wait``, the path ``torch.distributed.pipelining`` takes.

Half the median round trip is the one-way time.  The latency is the median raw one-way time of
messages up to 4 KiB; the bandwidth is the least-squares fit of ``(time - latency) = size /
bandwidth`` over messages of 64 KiB and more; the median extra cost of the p2p path over the
raw one at small sizes is the per-message software ``overhead`` (:func:`fit_link`).  The raw
samples themselves go into the link too: the cost model interpolates them, since a loopback or
NIC transport changes protocol with the message size and no single line fits all sizes.  Times
are the 25th percentile of the repeats: the uncontended transfer.  (On a busy host a rank is
sometimes woken milliseconds late; that cost shows up in real steps and is left to the engine's
cost, measured on real steps: :mod:`pipeplan.runtime.engine_fit`.)

All ranks then time the all-reduce the runtime runs for tied gradients (flatten, ``all_reduce``
over the ranks, copy back; ``pipeplan.runtime.engine``), after a barrier, at the same sizes
(:func:`time_allreduce`); the cluster's ``allreduce`` link is fitted to those times as the link
is to the ping-pong's.

torch is imported inside the functions that run on the ranks, so the fit imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.types import Link

__all__ = [
    "fit_affine",
    "fit_link",
    "message_sizes",
    "time_allreduce",
    "time_collectives",
    "time_pingpong",
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


def time_pingpong(sizes: list[int], repeats: int, device: str) -> list[tuple[int, float, float]]:
    """(bytes, raw one-way s, p2p one-way s) per size: ranks 0 and 1 play ping-pong, each time
    the 25th percentile of ``repeats`` round trips halved, after two warm-up ones."""
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


def time_allreduce(sizes: list[int], repeats: int, device: str) -> list[tuple[int, float]]:
    """(bytes, seconds) of the runtime's gradient sum on every rank, from a barrier: one
    in-place all-reduce, as a tied parameter's and a replica's gradients are summed."""
    import torch
    import torch.distributed as dist

    out: list[tuple[int, float]] = []
    for size in sizes:
        param = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=device)
        grad = torch.ones_like(param)
        # in place, as pipeplan.runtime.gradsync's
        out.append((size, _timed(lambda g=grad: dist.all_reduce(g), repeats, device)))
    return out


def _timed(call: Any, repeats: int, device: str) -> float:
    """The low figure of ``repeats`` timed calls on every rank, each from a barrier, after two
    warm-up calls."""
    import torch
    import torch.distributed as dist

    times = []
    for i in range(repeats + 2):
        dist.barrier()
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if device != "cpu":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return _low(times)


def time_collectives(
    sizes: list[int], repeats: int, device: str
) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) of FSDP2's two collectives on every rank, from a barrier, for w
    ``sizes`` of the unsharded tensor: ``reduce_scatter`` (w in, w / n out, summed, as FSDP
    reduces gradients) and ``all_gather`` (w / n in, w out, as FSDP gathers parameters)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    out: dict[str, list[tuple[int, float]]] = {"reduce_scatter": [], "all_gather": []}
    for size in sizes:
        shard = max(size // 4 // n, 1)
        whole = torch.ones(shard * n, dtype=torch.float32, device=device)
        part = torch.zeros(shard, dtype=torch.float32, device=device)
        calls = {
            "reduce_scatter": lambda part=part, whole=whole: dist.reduce_scatter_tensor(
                part, whole
            ),
            "all_gather": lambda part=part, whole=whole: dist.all_gather_into_tensor(whole, part),
        }
        for name, call in calls.items():
            out[name].append((shard * n * 4, _timed(call, repeats, device)))
    return out


def fit_affine(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per byte, seconds) of the least-squares line through (bytes, seconds), both
    clipped at 0: a collective's cost as :mod:`pipeplan.planner.collectives` takes it.

    >>> [f"{v:.3g}" for v in fit_affine([(1000, 2e-6 + 1e-5), (3000, 6e-6 + 1e-5)])]
    ['2e-09', '1e-05']
    """
    if len(points) < 2:
        raise InvalidRequestError("a collective's fit needs at least two sizes")
    x = np.array([b for b, _ in points], dtype=np.float64)
    y = np.array([t for _, t in points], dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    slope = max(float(slope), 0.0)
    if slope == 0.0:
        intercept = float(np.mean(y))
    return slope, max(float(intercept), 0.0)


def ring_link(allreduce: Link, ranks: int) -> Link:
    """The link whose ring all-reduce over ``ranks`` ranks takes what ``allreduce`` measured
    there: a ring sends 2 (n - 1) / n of the bytes and pays 2 (n - 1) latencies
    (:func:`pipeplan.planner.collectives.collective_cost`), so the measured bandwidth B_a and
    latency L_a give B = 2 (n - 1) / n B_a and L = L_a / (2 (n - 1)).

    >>> link = ring_link(Link(bandwidth_Bps=1e9, latency_s=1e-4), 2)
    >>> link.bandwidth_Bps, link.latency_s
    (1000000000.0, 5e-05)
    """
    if ranks < 2:
        raise InvalidRequestError(f"a ring all-reduce needs at least 2 ranks, got {ranks}")
    bw = allreduce.bandwidth_Bps
    return Link(
        bandwidth_Bps=None if bw is None else bw * 2 * (ranks - 1) / ranks,
        latency_s=allreduce.latency_s / (2 * (ranks - 1)),
    )
