"""What ``pipeplan`` prints on the terminal: its two consoles, the tables of plans and profiles.

``console`` takes the results (stdout), ``err_console`` the errors, warnings and notes (stderr);
both are 120 and 200 columns wide when not writing to a terminal, so logs and tests see the same
layout on any machine.  ``print_plan`` and ``print_profile`` are what ``pipeplan plan`` and
``pipeplan show`` print; ``compare_table`` and ``stage_table`` what ``pipeplan compare``
prints, both within 80 columns.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from rich import box
from rich.console import Console
from rich.table import Table

from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Cluster, Link, Plan, Profile

if TYPE_CHECKING:  # compare_table's frame; the error line of the command line needs no pandas
    import pandas as pd

__all__ = [
    "batch_norm_note",
    "compare_table",
    "console",
    "data_parallel_note",
    "err_console",
    "frontier_table",
    "print_plan",
    "print_profile",
    "stage_table",
    "tensor_parallel_note",
    "uncalibrated_note",
]
_PROVE = "T deterministic seconds of CP-SAT a candidate, docs/exact_order.md"

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
    if cluster.data_parallel > 1 and not cluster.collectives:
        free.append(
            "measured data-parallel collectives (all-gather, reduce-scatter and all-reduce are "
            "modelled as rings on the link)"
        )
    if not free:
        return None
    return (
        f"uncalibrated: this plan charges nothing for {'; '.join(free)} (pipeplan calibrate "
        f"measures them; plan with --cluster cluster.json, or --bandwidth/--latency for links)"
    )


def data_parallel_note(p: Plan) -> str:
    """One line on a plan's data-parallel axis: d, the mode, the collectives it charges, and
    where each replica's ranks sit."""
    from pipeplan.planner.collectives import collective_cost

    c, d = p.cluster, p.cluster.data_parallel
    ranks = p.pipeline_ranks
    if c.data_parallel_mode == "shard":
        (a1, b1), (a2, b2) = collective_cost(c, "reduce_scatter"), collective_cost(c, "all_gather")
        what = (
            f"each stage's parameters, gradients and optimizer states are sharded over them "
            f"(FSDP2): all-gathered for the step, reduce-scattered after its last backward "
            f"({(a1 + a2) * 1e9:.3g} ns/B + {(b1 + b2) * 1e6:.3g} us, in its update time)"
        )
    else:
        a, b = collective_cost(c, "all_reduce")
        what = (
            f"each stage all-reduces its gradients over them before its update "
            f"({a * 1e9:.3g} ns/B + {b * 1e6:.3g} us, in its update time)"
        )
    return (
        f"{d} data-parallel ranks per stage ({c.data_parallel_mode}), {p.batch_size} samples "
        f"each (global batch {p.batch_size * d}, {p.throughput * d:.1f} samples/s): {what}; "
        + (
            f"replica r's rank j is global rank r * {ranks} + j"
            if c.tensor_parallel == 1
            else f"replica r's rank j is global ranks (r * {ranks} + j) * {c.tensor_parallel} "
            f"+ 0..{c.tensor_parallel - 1}"
        )
    )


def tensor_parallel_note(p: Plan) -> str:
    """One line on a plan's tensor-parallel axis: t, sequence parallelism, and the links each
    axis is priced on (:func:`pipeplan.solvers.devices.axis_links`)."""
    c = p.cluster
    intra = c.intra_node_link or c.link

    def rate(link: Link) -> str:
        bw = link.bandwidth_Bps
        return "free" if bw is None else f"{bw / 1e9:.3g} GB/s"

    modes = [m for m, on in (("sequence", c.sequence_parallel), ("loss", c.loss_parallel)) if on]
    return (
        f"{c.tensor_parallel} tensor-parallel ranks per pipeline rank"
        + (f" ({' and '.join(modes)} parallel)" if modes else "")
        + f": blocks split Megatron-style, their collectives on the intra-node link "
        f"({rate(intra)}); pipeline transfers at {rate(c.link)}"
        + (
            f", data-parallel collectives at {rate(c.replica_link or c.link)}"
            if c.data_parallel > 1
            else ""
        )
    )


def print_plan(p: Plan) -> None:
    """Print plan ``p`` as a table, one row per stage (whether it recomputes; ``*`` marks the
    slowest), then a summary line: step time, simulated step time, lower bound, bubble,
    throughput and the options."""
    layout = (
        f"{p.n_stages} stages"
        if p.stages_per_rank == 1
        else f"{p.pipeline_ranks} ranks x {p.stages_per_rank} chunks ({p.schedule})"
    )
    table = Table(title=f"{p.model}: {layout}, m = {p.microbatches} ({p.solver})")
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
    if p.solver == "schedules" and p.status == "feasible" and (p.gap or 0) > 0.01:
        console.print(f"to narrow the gap: --prove T (the exact model: {_PROVE})", highlight=False)
    if p.weighed:
        console.print(weighed_table(p))
    if p.rank_peak_bytes:
        from pipeplan.planner.families import stages_of_rank

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
    if p.cluster.tensor_parallel > 1:
        console.print(tensor_parallel_note(p), highlight=False)
    if d > 1:
        console.print(data_parallel_note(p), highlight=False)
    if p.batch_dependent_layers:
        console.print(batch_norm_note(p.batch_dependent_layers, p.microbatches))
    note = uncalibrated_note(p.cluster)
    if note:
        console.print(note)
    for sync in p.tied_syncs:
        stages = ", ".join(map(str, sync.stages))
        if p.stages_per_rank > 1:  # chunks: what sums is the ranks holding them
            from pipeplan.planner.families import rank_of_stage

            owner = rank_of_stage(p.schedule, p.pipeline_ranks, p.stages_per_rank)
            holders = sorted({owner[c] for c in sync.stages})
            if len(holders) == 1:
                console.print(
                    f"tied parameters: chunks {stages} share them on rank {holders[0]} "
                    f"({format_bytes(sync.bytes)}, one gradient: no all-reduce)"
                )
                continue
            stages = f"{stages} (ranks {', '.join(map(str, holders))})"
        console.print(
            f"tied gradients: stages {stages} sum {format_bytes(sync.bytes)} after their last "
            f"backward, {sync.seconds * 1e3:.3f} ms, before updating"
        )


def weighed_table(p: Plan) -> Table:
    """What ``--schedule auto`` weighed: each family's best plan found (v, m, its replayed step
    and its ratio to the chosen plan's), or the lower bound that ruled it out."""
    chosen = p.simulated_step_time_s or p.step_time_s
    table = Table(
        title="schedule auto weighed (each family's best plan found)", title_justify="left"
    )
    for col in ("family", "v", "m", "step ms", "x chosen"):
        table.add_column(col, justify="left" if col == "family" else "right", no_wrap=True)
    for w in sorted(p.weighed, key=lambda w: (w.step_time_s is None, w.step_time_s or 0.0)):
        if w.step_time_s is None:
            why = "no fit" if w.lower_bound_s < chosen else f"bound {w.lower_bound_s * 1e3:.1f}"
            table.add_row(w.family, str(w.stages_per_rank), str(w.microbatches), why, "-")
            continue
        mark = " (chosen)" if (w.family, w.microbatches, w.stages_per_rank) == (
            p.schedule, p.microbatches, p.stages_per_rank) else ""  # fmt: skip
        table.add_row(
            w.family,
            str(w.stages_per_rank),
            str(w.microbatches),
            f"{w.step_time_s * 1e3:.3f}",
            f"{w.step_time_s / chosen:.2f}{mark}",
        )
    return table


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


def _short(v: float) -> str:
    """Three significant digits, never in e-notation: ``66.8``, ``256``, ``1024``."""
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _memory_pair(used: float, limit: float) -> str:
    """A stage's memory against its limit: ``159/256 MiB`` in the larger one's unit, or each
    in its own when the smaller would read 0.0 in it (``66.8 MiB/1 TiB``).

    >>> _memory_pair(159 * 2**20, 256 * 2**20), _memory_pair(66.8 * 2**20, 2**40)
    ('159/256 MiB', '66.8 MiB/1 TiB')
    """
    units = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))

    def scaled(n: float) -> tuple[float, str]:
        return next((n / f, u) for u, f in units if n >= f or f == 1)

    big, unit = scaled(max(used, limit))
    scale = max(used, limit) / big if big else 1.0
    if min(used, limit) >= scale / 10:
        return f"{_short(used / scale)}/{_short(limit / scale)} {unit}"
    (u, uu), (v, vu) = scaled(used), scaled(limit)
    return f"{_short(u)} {uu}/{_short(v)} {vu}"


def compare_table(df: pd.DataFrame, width: int = 80) -> Table:
    """The summary of :func:`pipeplan.report.compare.compare_frame`'s rows that fits ``width``
    columns: fastest first (infeasible plans last), the best's ratio written ``best``.

    Columns: plan, solver, status, m, p×d (stages × data-parallel replicas), step ms, ratio
    (step over the best feasible plan's; ``-`` for a plan that does not fit), bubble, memory
    (the fullest stage against its device's limit, red when over) and samples/s of all
    replicas.  The plan's name gets what the other columns leave (at least 8 characters, the
    solver's name giving way next) and ends in an ellipsis where longer, so no row wraps."""
    from rich.cells import cell_len

    order = sorted(range(len(df)), key=lambda i: (not df["feasible"][i], df["step_ms"][i]))
    heads = ("plan", "solver", "status", "m", "p×d", "step ms", "ratio", "bubble", "memory",
             "samples/s")  # fmt: skip
    rows: list[tuple[str, ...]] = []
    best = True
    for i in order:
        r = df.iloc[i]
        ratio = float(r["ratio"])
        if math.isnan(ratio) or not bool(r["feasible"]):
            ratio_text = "-"
        elif best:
            ratio_text, best = "best", False
        else:
            ratio_text = f"{ratio:.2f}×"
        rows.append((
            str(r["name"]),
            str(r["solver"]),
            str(r["status"]),
            str(int(r["m"])),
            f"{int(r['stages'])}×{int(r['replicas'])}",
            f"{float(r['step_ms']):.1f}",
            ratio_text,
            f"{float(r['bubble']):.0%}",
            _memory_pair(float(r["peak_mem"]), float(r["mem_limit"])),
            f"{float(r['samples_s']):.1f}",
        ))  # fmt: skip
    natural = [
        max(cell_len(x) for x in (h, *(row[k] for row in rows))) for k, h in enumerate(heads)
    ]
    widths = list(natural)
    room = width - sum(natural[1:]) - (len(heads) - 1)
    widths[0] = min(natural[0], max(8, room))
    if room < 8:  # the solver's name gives way next, down to 6 characters
        widths[1] = max(6, natural[1] - (8 - room))
    table = Table(
        title=f"{len(df)} plans, fastest first",
        caption="ratio: step over the best plan's; memory: the fullest device against its limit",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        pad_edge=False,
        show_edge=False,
    )
    for k, head in enumerate(heads):
        table.add_column(
            head,
            justify="left" if k < 3 else "right",
            no_wrap=True,
            overflow="ellipsis",
            width=widths[k],
        )
    for i, row in zip(order, rows, strict=True):
        feasible = bool(df["feasible"][i])
        memory = row[8] if feasible else f"[red]{row[8]}[/red]"
        table.add_row(*row[:8], memory, row[9], style="bold" if row[6] == "best" else None)
    return table


def stage_table(p: Plan, name: str) -> Table:
    """Plan ``p``'s stages within 80 columns, one row per stage (per chunk, with the rank that
    runs it, for a multi-chunk plan): its units, F, B and C per
    micro-batch, t_j (``*`` marks the slowest), m·t_j (its busy time per step, which compares
    plans of different m) and its memory against its device's limit."""
    v = p.stages_per_rank
    layout = (
        f"{p.n_stages} stages"
        if v == 1
        else f"{p.pipeline_ranks} ranks x {v} chunks ({p.schedule})"
    )
    table = Table(
        title=f"{name}: {layout}, m = {p.microbatches} ({p.solver})",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        pad_edge=False,
        show_edge=False,
    )
    owner: tuple[int, ...] = ()
    if v > 1:  # which rank runs each chunk
        from pipeplan.planner.families import rank_of_stage

        owner = tuple(rank_of_stage(p.schedule, p.pipeline_ranks, v))
        table.add_column("rank", justify="right")
    table.add_column("stage" if v == 1 else "chunk", justify="right")
    table.add_column("units", overflow="ellipsis", no_wrap=True, min_width=8)
    for col in ("F ms", "B ms", "C ms", "t ms", "m·t ms", "memory"):
        table.add_column(col, justify="right", no_wrap=True)
    slowest = max(s.time_s for s in p.stages)
    for s in p.stages:
        memory = _memory_pair(s.memory.total, s.memory_limit)
        table.add_row(
            *([str(owner[s.index])] if owner else []),
            str(s.index),
            f"{s.first_unit}-{s.last_unit} {s.unit_names[0]}..{s.unit_names[-1]}"
            + (" (recompute)" if s.recompute else ""),
            f"{s.forward_s * 1e3:.2f}",
            f"{s.backward_s * 1e3:.2f}",
            f"{s.comm_s * 1e3:.2f}",
            f"{s.time_s * 1e3:.2f}" + ("*" if s.time_s == slowest else " "),
            f"{s.time_s * p.microbatches * 1e3:.1f}",
            memory if s.feasible else f"[red]{memory} over[/red]",
        )
    return table


class FrontierRow(Protocol):
    """One (depth, tensor-parallel degree, data-parallel mode) of ``plan --devices``
    (:class:`pipeplan.solvers.devices.DeviceChoice`)."""

    @property
    def stages(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def mode(self) -> str: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def plan(self) -> Plan | None: ...
    @property
    def reason(self) -> str: ...
    @property
    def throughput(self) -> float: ...


def frontier_table(devices: int, batch: int, choices: Sequence[FrontierRow]) -> Table:
    """The (depth, data-parallel mode) pairs ``plan --devices`` weighed, one row each, the best
    first; where several tensor-parallel degrees were weighed, the best plan of each (pp, tp)
    pair (its mode the better one) and a tp column."""
    best = choices[0]
    mesh = len({c.tensor_parallel for c in choices}) > 1 or best.tensor_parallel > 1
    if mesh:
        seen: set[tuple[int, int]] = set()
        rows: list[FrontierRow] = []
        for c in choices:  # best first: the first of each (pp, tp) is its best
            if (c.stages, c.tensor_parallel) not in seen:
                seen.add((c.stages, c.tensor_parallel))
                rows.append(c)
        choices = rows
    table = Table(title=f"{devices} devices, global batch {batch}")
    cols = ("pp", *(("tp",) if mesh else ()), "dp", "mode", "family", "m", "step", "samples/s",
            "peak memory", "note")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("mode", "family", "note") else "right")
    for c in choices:
        tp = (str(c.tensor_parallel),) if mesh else ()
        if c.plan is None:
            pp, dp = (str(c.stages), str(c.replicas)) if c.stages else ("-", "-")
            table.add_row(pp, *tp, dp, c.mode, "-", "-", "-", "-", "-", c.reason)
            continue
        note = "best" if c is best else f"{c.throughput / best.throughput - 1:+.1%} throughput"
        pl = c.plan
        mem = max([*pl.rank_peak_bytes, *(s.memory.total for s in pl.stages)])
        v = pl.stages_per_rank
        table.add_row(
            str(c.stages),
            *tp,
            str(c.replicas),
            c.mode,
            pl.schedule if v == 1 else f"{pl.schedule} v={v}",
            str(pl.microbatches),
            f"{(pl.simulated_step_time_s or pl.step_time_s) * 1e3:.4g} ms",
            f"{c.throughput:.4g}",
            format_bytes(mem),
            note,
        )
    return table
