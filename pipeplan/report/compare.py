"""Side-by-side comparison of plans: one row per plan, rendered as a table, CSV, JSON or Markdown.

Columns: ``name`` (the file or label), ``solver``, ``status``, ``feasible``, ``m``, ``stages``,
``replicas`` (data-parallel copies of the pipeline), ``stage_ms`` and ``stage_mem``
(per-stage t_j in milliseconds and M_j in bytes, joined by ``/``; M_j in binary units in the
formats for people, :func:`render`), ``slowest_ms`` (max_j t_j), ``peak_mem`` and ``mem_limit`` (M_j and its device's limit, in
bytes, of the stage that uses the largest share of its device), ``bubble`` (bubble fraction),
``step_ms`` (predicted step time), ``samples_s`` (samples per second of all replicas
together) and ``ratio`` (step time over the best *feasible* plan's; NaN when no plan is
feasible).  The terminal's summary of these rows, which fits 80 columns, is
:func:`pipeplan.report.terminal.compare_table`; each plan's stages,
:func:`pipeplan.report.terminal.stage_table`.
Plans of different profiles or clusters can be compared, but the ratio is only meaningful for
one profile on one cluster.  O(sum of stages).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Literal

import pandas as pd

from pipeplan.planner.errors import InvalidRequestError
from pipeplan.planner.io import format_bytes
from pipeplan.planner.types import Plan

__all__ = [
    "FORMATS",
    "Format",
    "compare_frame",
    "format_cell",
    "human",
    "render",
    "to_markdown",
    "unlike_work",
]

Format = Literal["table", "csv", "json", "markdown"]
FORMATS: tuple[str, ...] = ("table", "csv", "json", "markdown")

COLUMNS = [
    "name",
    "solver",
    "status",
    "feasible",
    "m",
    "stages",
    "replicas",
    "stage_ms",
    "stage_mem",
    "slowest_ms",
    "peak_mem",
    "mem_limit",
    "bubble",
    "step_ms",
    "samples_s",
    "ratio",
]


def compare_frame(plans: Sequence[Plan], names: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per plan, with its step time relative to the best feasible plan.

    >>> from pipeplan.profiler.synthetic import synthetic_profile
    >>> from pipeplan.planner.types import Cluster
    >>> from pipeplan.solvers import SOLVERS
    >>> prof, clus = synthetic_profile(12, batch_size=8), Cluster.homogeneous(3, 2**40)
    >>> df = compare_frame([SOLVERS[s](prof, clus, None) for s in ("dp", "uniform")])
    >>> list(df["name"]), float(df["ratio"][0]), bool(df["ratio"][1] >= 1)
    (['dp', 'uniform'], 1.0, True)
    """
    if names is None:
        names = [p.solver for p in plans]
    if len(names) != len(plans):
        raise InvalidRequestError(f"{len(names)} names for {len(plans)} plans; give one per plan")
    feasible = [p.step_time_s for p in plans if p.feasible]
    best = min(feasible) if feasible else math.nan
    rows = []
    for name, p in zip(names, plans):
        times = [s.time_s for s in p.stages]
        fullest = max(p.stages, key=lambda s: s.memory.total / max(s.memory_limit, 1))
        peak, limit = fullest.memory.total, fullest.memory_limit
        if p.stages_per_rank > 1 and p.rank_peak_bytes:  # chunks: a device holds several
            limits = [d.memory_bytes for d in p.cluster.devices]
            q = max(range(len(limits)), key=lambda r: p.rank_peak_bytes[r] / max(limits[r], 1))  # type: ignore[index]
            peak, limit = p.rank_peak_bytes[q], limits[q]
        rows.append(
            {
                "name": name,
                "solver": p.solver,
                "status": p.status,
                "feasible": p.feasible,
                "m": p.microbatches,
                "stages": p.pipeline_ranks,
                "replicas": p.cluster.data_parallel,
                "stage_ms": "/".join(f"{t * 1e3:.3f}" for t in times),
                "stage_mem": "/".join(str(s.memory.total) for s in p.stages),
                "slowest_ms": max(times) * 1e3,
                "peak_mem": peak,
                "mem_limit": limit,
                "bubble": p.bubble_fraction,
                "step_ms": p.step_time_s * 1e3,
                "samples_s": p.throughput * p.cluster.data_parallel,
                "ratio": p.step_time_s / best if best > 0 else math.nan,
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def unlike_work(plans: Sequence[Plan]) -> str | None:
    """One line when ``plans`` are of different models or global batch sizes (their ratios
    then compare unlike work), else ``None``."""
    for what, values in (
        ("models", [p.model for p in plans]),
        ("global batch sizes", [str(p.batch_size * p.cluster.data_parallel) for p in plans]),
    ):
        if len(set(values)) > 1:
            return (
                f"these plans are of different {what} ({', '.join(dict.fromkeys(values))}): "
                "their ratios compare unlike work"
            )
    return None


def format_cell(value: object) -> str:
    """A cell as text: booleans as yes/NO, floats to four significant digits, NaN as ``-``."""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table (numbers right-aligned), without ``tabulate``."""
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and df[c].dtype != bool for c in df.columns]
    lines = [
        "| " + " | ".join(str(c) for c in df.columns) + " |",
        "|" + "|".join("---:" if num else ":---" for num in numeric) + "|",
    ]
    for row in df.itertuples(index=False):
        cells = [format_cell(v).replace("|", "\\|") for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def human(df: pd.DataFrame) -> pd.DataFrame:
    """The frame for people to read: ``stage_mem``, ``peak_mem`` and ``mem_limit`` in binary
    units (``1.50 GiB/2.00 GiB``)."""
    out = df.copy()
    for col in ("peak_mem", "mem_limit"):
        out[col] = [format_bytes(int(b)) for b in df[col]]
    out["stage_mem"] = [
        "/".join(format_bytes(int(b)) for b in str(v).split("/")) for v in df["stage_mem"]
    ]
    return out


def render(df: pd.DataFrame, fmt: str) -> str:
    """The frame as text: ``table`` (aligned columns), ``csv``, ``json`` (records) or ``markdown``.
    The formats for people (``table``, ``markdown``) give per-stage memory in binary units; the
    formats for programs (``csv``, ``json``) keep it in bytes."""
    if fmt in ("table", "markdown"):
        df = human(df)
    if fmt == "csv":
        return str(df.to_csv(index=False))
    if fmt == "json":
        records = [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in df.to_dict(orient="records")
        ]
        return json.dumps(records, indent=2, allow_nan=False, default=_json_default) + "\n"
    if fmt == "markdown":
        return to_markdown(df)
    if fmt == "table":
        cells = [[str(c) for c in df.columns]]
        cells += [[format_cell(v) for v in row] for row in df.itertuples(index=False)]
        widths = [max(len(r[i]) for r in cells) for i in range(len(df.columns))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells) + "\n"
    raise InvalidRequestError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")


def _json_default(value: object) -> object:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()  # type: ignore[no-any-return]
    raise TypeError(f"cannot serialise {type(value).__name__}")
