"""An earlier commit's DP beside this tree's, on the same instances, timed in interleaved rounds.

The earlier solver is read from git (every ``pipeplan/solvers/dp*.py`` at ``rev``) into a package of its
own, ``base_solvers``, so both run in one process on the same profiles; it shares this tree's
``planner`` (the cost model both minimise).  Each round times the earlier solver and then this
one on every instance, so that a busy host slows both alike; the medians over the rounds, their
ratio and the ratio's spread over the rounds are reported, with each solver's status (optimal,
or feasible with its proven gap) and step time.
"""

from __future__ import annotations

import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeplan.planner.types import Cluster, Link, PlanOptions, Profile
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers.dp import _partition

ROOT = Path(__file__).resolve().parents[2]
LINK = Link(bandwidth_Bps=1e10, latency_s=1e-5)
ADAM = 3e-9
"""An Adam step's seconds per parameter byte in the synthetic profiles (3 s for 1000 units)."""

Partition = Callable[[Profile, Cluster, PlanOptions], Any]

INSTANCES: list[dict[str, Any]] = [
    {"units": 1000, "stages": 64, "update": 0.0},
    {"units": 1000, "stages": 64, "update": ADAM},
    {"units": 1000, "stages": 64, "update": ADAM, "tied": True},
    {"units": 1000, "stages": 16, "update": ADAM},
    {"units": 2000, "stages": 128, "update": ADAM},
    {"units": 1000, "stages": 64, "update": ADAM, "update_contention": 0.3},
    {"units": 1000, "stages": 64, "update": ADAM, "tied": True, "update_contention": 0.3},
]
"""The issue's instances: 8 micro-batch counts, unlimited memory, a 10 GB/s link, Adam."""


def load_base(rev: str) -> Partition:
    """``_partition`` of the DP at git revision ``rev``, as a module apart from this tree's."""
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "pipeplan/solvers/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    pkg = Path(tempfile.mkdtemp(prefix="pipeplan-base-")) / "base_solvers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in names:
        if Path(name).name.startswith("dp") and name.endswith(".py"):
            src = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{rev}:{name}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            (pkg / Path(name).name).write_text(
                src.replace("from pipeplan.solvers.dp", "from base_solvers.dp")
            )
    sys.path.insert(0, str(pkg.parent))
    module = importlib.import_module("base_solvers.dp")
    partition: Partition = module._partition
    return partition


def instance(spec: dict[str, Any]) -> tuple[Profile, Cluster, PlanOptions]:
    prof = synthetic_profile(
        spec["units"],
        batch_size=128,
        microbatch_sizes=[1, 2, 4, 8, 16, 32, 64, 128],
        heavy_ends=True,
        spread=0.5,
        tied=spec.get("tied", False),
        update_s_per_byte=spec["update"],
    )
    clus = Cluster.homogeneous(
        spec["stages"], 2**50, LINK, update_contention=spec.get("update_contention", 0.0)
    )
    return prof, clus, PlanOptions(checkpoint="except_last")  # what the base commit knows


def label(spec: dict[str, Any]) -> str:
    parts = [f"{spec['units']} x {spec['stages']} x 8"]
    parts.append("Adam" if spec["update"] else "no update")
    if spec.get("tied"):
        parts.append("tied ends")
    if spec.get("update_contention"):
        parts.append(f"kappa_u {spec['update_contention']}")
    return ", ".join(parts)


def _status(found: Any) -> tuple[str, float]:
    _, _, objective, bound = found
    gap = max(0.0, (objective - bound) / objective)
    return ("optimal" if bound >= objective * (1 - 1e-12) else f"feasible ({gap:.3%})"), gap


def versus(
    rev: str, repeats: int, only: list[int] | None = None, auto: bool = False
) -> list[dict[str, Any]]:
    """``repeats`` interleaved rounds over the instances; one row per instance.  With ``auto``
    the "base" is this tree's DP under ``except_last`` and the "new" the same DP under
    ``auto`` (every stage chooses: more to search), not the commit ``rev``'s."""
    base: Partition = load_base(rev) if not auto else _partition
    new: Partition = _partition
    if auto:

        def new(prof: Profile, clus: Cluster, options: PlanOptions) -> Any:
            return _partition(prof, clus, options.model_copy(update={"checkpoint": "auto"}))

    specs = [s for i, s in enumerate(INSTANCES) if only is None or i in only]
    cases = [instance(s) for s in specs]
    times: list[dict[str, list[float]]] = [{"base": [], "new": []} for _ in specs]
    results: list[dict[str, Any]] = [{} for _ in specs]
    for _ in range(repeats):
        for i, case in enumerate(cases):
            for name, solve in (("base", base), ("new", new)):
                t0 = time.perf_counter()
                found = solve(*case)
                times[i][name].append(time.perf_counter() - t0)
                results[i][name] = found
    rows = []
    for spec, t, res in zip(specs, times, results):
        ratios = [b / n for b, n in zip(t["base"], t["new"])]
        base_status, _ = _status(res["base"])
        new_status, _ = _status(res["new"])
        row = {
            "instance": label(spec),
            "base_s": statistics.median(t["base"]),
            "new_s": statistics.median(t["new"]),
            "speedup": statistics.median(ratios),
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "base_status": base_status,
            "new_status": new_status,
            "new_over_base_step": res["new"][2] / res["base"][2],
            "base_runs_s": t["base"],
            "new_runs_s": t["new"],
        }
        print(row, flush=True)
        rows.append(row)
    return rows
