"""``pipeplan show`` for the files that are not plans or profiles: a run report and a cluster.

A run report alone holds what the run measured: per stage (chunk) its forward and backward per
micro-batch (I and W where the backward is split), per rank its peak memory, the step times and
the last step's events; :func:`report_tables` draws them, with the step the plan predicted.
Given the plan that ran, ``pipeplan show REPORT --plan PLAN`` prints the runtime's own measured
against predicted tables instead (:func:`pipeplan.runtime.records.print_comparison`).  A
cluster file holds the devices, the links, the engine's costs and the contention
(:func:`cluster_tables`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from rich import box
from rich.table import Table

from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, Link, RunReport

__all__ = ["cluster_tables", "report_tables"]


def _ms(values: Sequence[float]) -> str:
    return f"{statistics.mean(values) * 1e3:.3f}" if values else "-"


def _bytes(n: int | None) -> str:
    return format_bytes(n) if n is not None else "-"


def report_tables(report: RunReport, bubble: float | None) -> list[Table | str]:
    """The run's stages (mean milliseconds per micro-batch, peak memory), its ranks' memory
    where several chunks share a rank, and lines for the step, the bubble (``bubble``: the
    measured one, computed by the caller from the events) and the events by kind."""
    split = any(s.backward_input_s for s in report.stages)
    stages = Table(
        title=f"{report.model}: measured ({report.backend}, {report.world_size} ranks, "
        f"{report.steps} steps after {report.warmup_steps} warm-up)",
        box=box.SIMPLE_HEAD,
    )
    heads = ["stage", "rank", "F ms", "B ms", *(["I ms", "W ms"] if split else []), "peak mem",
             "resident"]  # fmt: skip
    for h in heads:
        stages.add_column(h, justify="right")
    for s in report.stages:
        row = [str(s.stage), "-" if s.rank is None else str(s.rank), _ms(s.forward_s),
               _ms(s.backward_s)]  # fmt: skip
        row += [_ms(s.backward_input_s), _ms(s.backward_weight_s)] if split else []
        row += [_bytes(s.peak_memory_bytes), _bytes(s.resident_growth_bytes)]
        stages.add_row(*row)
    out: list[Table | str] = [stages]
    if report.ranks and any(len(r.stages) > 1 for r in report.ranks):
        ranks = Table(title="memory per rank", box=box.SIMPLE_HEAD)
        for h in ("rank", "chunks", "peak mem", "resident"):
            ranks.add_column(h, justify="right")
        for r in report.ranks:
            ranks.add_row(str(r.rank), ", ".join(map(str, r.stages)),
                          _bytes(r.peak_memory_bytes), _bytes(r.resident_growth_bytes))  # fmt: skip
        out.append(ranks)
    steps = report.step_times_s
    err = (report.step_time_s - report.predicted_step_time_s) / report.predicted_step_time_s
    out.append(
        f"step time {report.step_time_s * 1e3:.3f} ms measured (median of {len(steps)}, "
        f"{min(steps) * 1e3:.3f}-{max(steps) * 1e3:.3f}), "
        f"{report.predicted_step_time_s * 1e3:.3f} ms predicted ({err:+.1%})"
    )
    if bubble is not None:
        out.append(f"bubble fraction {bubble:.1%} measured on the last step")
    if report.losses:
        out.append(
            f"loss {report.losses[0]:.6g} at the first step, {report.losses[-1]:.6g} at the last"
        )
    kinds = Counter(str(e["kind"]) for e in report.events)
    if kinds:
        out.append(
            "events of the last step: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        )
    out.append("per-stage predictions: pipeplan show REPORT --plan PLAN (the plan that ran)")
    return out


def _link(link: Link | None) -> tuple[str, str, str, str]:
    if link is None:
        return ("-", "-", "-", "-")
    bw = "free" if link.bandwidth_Bps is None else f"{link.bandwidth_Bps / 1e9:.3g} GB/s"
    return (bw, f"{link.latency_s * 1e6:.3g} us", f"{link.overhead_s * 1e6:.3g} us",
            str(len(link.samples)) if link.samples else "-")  # fmt: skip


def cluster_tables(cluster: Cluster) -> list[Table | str]:
    """The cluster's devices (grouped where identical), its links (bandwidth, latency, the
    per-message overhead and the measured sizes), the engine's costs, the contention and the
    data-parallel and tensor-parallel degrees."""
    devices = Table(title=f"{cluster.n_stages} devices", box=box.SIMPLE_HEAD)
    for h in ("devices", "name", "memory", "speed"):
        devices.add_column(h, justify="right")
    groups = Counter((d.memory_bytes, d.speed) for d in cluster.devices)
    for (mem, speed), n in groups.items():
        names = [d.name for d in cluster.devices if (d.memory_bytes, d.speed) == (mem, speed)]
        label = names[0] if n == 1 else f"{names[0]}..{names[-1]}"
        devices.add_row(str(n), label, format_bytes(mem), f"{speed:g}")
    links = Table(title="links", box=box.SIMPLE_HEAD)
    for h in ("link", "bandwidth", "latency", "overhead", "samples"):
        links.add_column(h, justify="left" if h == "link" else "right")
    for name, link in (
        ("between stages", cluster.link),
        ("between replicas", cluster.replica_link),
        ("inside a node", cluster.intra_node_link),
        ("tied all-reduce", cluster.allreduce),
    ):
        if link is not None or name == "between stages":
            links.add_row(name, *_link(link))
    out: list[Table | str] = [devices, links]
    out.append(
        f"engine: {cluster.op_overhead_s * 1e6:.1f} us per operation"
        + (
            f" ({cluster.solo_op_overhead_s * 1e6:.1f} us alone)"
            if cluster.solo_op_overhead_s is not None
            else ""
        )
        + f", {cluster.step_overhead_s * 1e3:.3f} ms per step; contention {cluster.contention:.3f}"
        f" (compute), {cluster.update_contention:.3f} (updates)"
    )
    for kind, (per_byte, fixed) in sorted(cluster.collectives.items()):
        out.append(
            f"{kind}: {per_byte * 1e9:.3g} ns per byte + {fixed * 1e6:.3g} us, measured on "
            f"{cluster.collective_ranks} ranks"
        )
    if cluster.data_parallel > 1 or cluster.tensor_parallel > 1:
        out.append(
            f"data parallel {cluster.data_parallel} ({cluster.data_parallel_mode}), tensor "
            f"parallel {cluster.tensor_parallel}"
            + (", sequence parallel" if cluster.sequence_parallel else "")
            + (", loss parallel" if cluster.loss_parallel else "")
        )
    return out
