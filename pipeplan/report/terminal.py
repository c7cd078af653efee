"""What ``pipeplan`` prints on the terminal: its two consoles, the tables of plans and profiles.

``console`` takes the results (stdout), ``err_console`` the errors, warnings and notes (stderr);
both are 120 and 200 columns wide when not writing to a terminal, so logs and tests see the same
layout on any machine.  ``print_plan`` and ``print_profile`` are what ``pipeplan plan`` and
``pipeplan show`` print.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, Plan, Profile

__all__ = [
    "batch_norm_note",
    "console",
    "err_console",
    "print_plan",
    "print_profile",
    "uncalibrated_note",
]

console = Console(width=None if sys.stdout.isatty() else 120, emoji=False)
"""Standard output: tables, results and the files written."""
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200, emoji=False)
"""Standard error: ``error: ...`` lines, warnings and notes."""


def batch_norm_note(layers: tuple[str, ...], m: int, choice: str | None = None) -> str:
    """What a pipeline changes for batch-dependent layers (BatchNorm), in one line; ``choice``
    is the run's ``--batch-norm`` (``None``: say what the choices are)."""
    names = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    head = (
        f"batch norm: {len(layers)} layer(s) ({names}) normalise each of the m = {m} "
        f"micro-batches with its own statistics; "
    )
    if choice == "deferred":
        return head + "their running statistics are updated once per step, over the whole batch"
    if choice == "microbatch":
        return head + f"their running statistics are updated m = {m} times per step"
    return head + (
        "`pipeplan run` updates their running statistics once per step over the whole batch "
        "(--batch-norm deferred, the default) or once per micro-batch (--batch-norm microbatch)"
    )


def uncalibrated_note(cluster: Cluster) -> str | None:
    """What a plan made without ``pipeplan calibrate`` does not charge, in one line (``None``
    when everything is charged)."""
    free = []
    if cluster.n_stages > 1 and cluster.link.bandwidth_Bps is None and not cluster.link.samples:
        free.append("transfers between stages")
    if cluster.op_overhead_s == 0 and cluster.step_overhead_s == 0:
        free.append("the pipeline engine's cost per operation and per step")
    if cluster.n_stages > 1 and cluster.contention == 0 and cluster.update_contention == 0:
        free.append("contention between stages that share a host")
    if not free:
        return None
    return (
        f"uncalibrated: this plan charges nothing for {'; '.join(free)} (pipeplan calibrate "
        f"measures them; plan with --cluster cluster.json, or --bandwidth/--latency for links)"
    )


def print_plan(p: Plan) -> None:
    """Print plan ``p`` as a table, one row per stage (whether it recomputes; ``*`` marks the
    slowest), then a summary line: step time, simulated step time, lower bound, bubble,
    throughput and the options."""
    table = Table(title=f"{p.model}: {p.n_stages} stages, m = {p.microbatches} ({p.solver})")
    cols = ("stage", "units", "recompute", "F ms", "B ms", "C ms", "t ms", "memory", "limit")
    for col in (*cols, "fits"):
        table.add_column(col, justify="right")
    slowest = max(s.time_s for s in p.stages)
    for s in p.stages:
        mark = "*" if s.time_s == slowest else ""
        table.add_row(
            str(s.index),
            f"{s.first_unit}-{s.last_unit} ({s.unit_names[0]}..{s.unit_names[-1]})",
            "yes" if s.recompute else "no",
            f"{s.forward_s * 1e3:.3f}",
            f"{s.backward_s * 1e3:.3f}",
            f"{s.comm_s * 1e3:.3f}",
            f"{s.time_s * 1e3:.3f}{mark}",
            format_bytes(s.memory.total),
            format_bytes(s.memory_limit),
            "yes" if s.feasible else "NO",
        )
    console.print(table)
    gap = f", gap {p.gap:.2%}" if p.gap is not None else ""
    console.print(
        f"step time {p.step_time_s * 1e3:.3f} ms (simulated "
        f"{(p.simulated_step_time_s or p.step_time_s) * 1e3:.3f} ms, lower bound "
        f"{(p.lower_bound_s or 0) * 1e3:.3f} ms), bubble {p.bubble_fraction:.1%}, "
        f"{p.throughput:.1f} samples/s, micro-batch size {p.microbatch_size}, "
        f"checkpoint {p.checkpoint}, schedule {p.schedule}, status {p.status}{gap}"
    )
    if p.rank_peak_bytes:
        from pipeplan.planner.schedules import stages_of_rank

        ranks = p.cluster.n_stages
        console.print(
            f"{p.schedule}: {p.stages_per_rank} chunk(s) per rank; "
            + "; ".join(
                f"rank {r} runs chunks "
                f"{', '.join(map(str, stages_of_rank(p.schedule, ranks, p.stages_per_rank, r)))}"
                f" (peak {format_bytes(p.rank_peak_bytes[r])})"
                for r in range(ranks)
            ),
            highlight=False,
        )
    d = p.cluster.data_parallel
    if d > 1:
        alpha, beta = p.cluster.replica_allreduce()
        console.print(
            f"{d} data-parallel replicas of this pipeline, {p.batch_size} samples each "
            f"(global batch {p.batch_size * d}, {p.throughput * d:.1f} samples/s): each stage "
            f"all-reduces its gradients over them before its update ({alpha * 1e9:.3g} ns/B + "
            f"{beta * 1e6:.3g} us, in its update time); replica r's stage j on rank "
            f"layout[r][j] = r * {p.n_stages} + j"
        )
    if p.batch_dependent_layers:
        console.print(batch_norm_note(p.batch_dependent_layers, p.microbatches))
    note = uncalibrated_note(p.cluster)
    if note:
        console.print(note)
    for sync in p.tied_syncs:
        stages = ", ".join(map(str, sync.stages))
        console.print(
            f"tied gradients: stages {stages} sum {format_bytes(sync.bytes)} after their last "
            f"backward, {sync.seconds * 1e3:.3f} ms, before updating"
        )


def print_profile(p: Profile) -> None:
    """Print profile ``p`` as a table, one row per unit with its times at the largest
    micro-batch size, saved and parameter bytes and the cut after it; then a summary line."""
    b = max(p.microbatch_sizes)
    table = Table(title=f"{p.model}: {p.n_units} units, traced with {p.tracer}, {p.device.name}")
    for col in ("unit", "name", f"fwd ms @{b}", f"bwd ms @{b}", "saved", "params", "cut/sample"):
        table.add_column(col, justify="right")
    for u in p.units:
        t = u.timings[b]
        cut = p.cuts[u.index].bytes_per_sample if u.index < len(p.cuts) else 0
        table.add_row(
            str(u.index),
            u.name if u.measured_as is None else f"{u.name} (= {u.measured_as})",
            f"{t.forward_s * 1e3:.3f}",
            f"{t.backward_s * 1e3:.3f}",
            format_bytes(t.saved_bytes),
            format_bytes(u.param_bytes),
            format_bytes(cut),
        )
    console.print(table)
    console.print(
        f"batch {p.batch_size}, micro-batch sizes {list(p.microbatch_sizes)}, dtype {p.dtype}, "
        f"torch {p.torch_version}, threads {p.device.threads}, fingerprint {p.graph_fingerprint}"
    )
    if p.grouping is not None:
        g = p.grouping
        opened = ", ".join(e or "(glue)" for e in g.expanded[:6])
        more = f" and {len(g.expanded) - 6} more" if len(g.expanded) > 6 else ""
        console.print(
            f"units: {g.base_units} blocks and glue, refined to {p.n_units} for up to "
            f"{g.max_stages} stages" + (f" (split: {opened}{more})" if g.expanded else "")
        )
    if p.method == "units":
        copied = sum(u.measured_as is not None for u in p.units)
        console.print(
            f"measured unit by unit (--method units): {p.n_units - copied} units measured, "
            f"{copied} copied from an identical one (= its index)"
        )
    if p.batch_dependent_layers:
        console.print(batch_norm_note(p.batch_dependent_layers, 1).split("; ")[0])
