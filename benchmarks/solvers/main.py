"""Solver benchmark: planning time of the DP and CP-SAT, and the baselines' plan quality.

    python -m benchmarks.solvers.main [--time-limit 20] [--sizes 100,500,1000,2000]
                                      [--stages 4,16,64] [--out benchmarks/solvers/results.json]

Part 1 (speed): synthetic profiles (log-normal unit times, spread 0.5, heavy first and last
units) of n units, batch 128, with 1 micro-batch option (m = 8) or 8 options (m = 1..128), on p
stages with unlimited memory and a 10 GB/s, 10 us link.  Each solver runs once; CP-SAT under a
time limit, its status (optimal, or feasible with a gap) recorded.

Part 2 (quality): each baseline's predicted step time over the optimum (the DP's), at the DP's
micro-batch count, for several synthetic profiles and stage counts, with the closed-form lower
bound ``S + (m - 1) max(S / p, max_u t_u)`` over the optimum alongside.

Part 3 (versus, ``--only versus``): the DP at an earlier commit (``--base``, by default the one
before the tail search became a branch and bound) beside this tree's, on the issue's instances
with the optimizer update charged, in ``--repeats`` interleaved rounds
(:mod:`benchmarks.solvers.versus`): median times, their ratio and its spread, and both
solvers' status.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.solvers.versus import versus
from pipeplan.planner.costmodel import lower_bound
from pipeplan.planner.errors import PipeplanError
from pipeplan.planner.evaluate import evaluate
from pipeplan.planner.types import Cluster, Link, PlanOptions, Profile
from pipeplan.profiler.synthetic import synthetic_profile
from pipeplan.solvers import SOLVERS
from pipeplan.solvers.cpsat import partition_cpsat
from pipeplan.solvers.dp import partition_dp

LINK = Link(bandwidth_Bps=1e10, latency_s=1e-5)
MEMORY = 2**50
BATCH = 128


def machine() -> dict[str, str]:
    import os
    from importlib.metadata import version

    import torch

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line),
            platform.processor(),
        )
    except OSError:
        model = platform.processor()
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ortools": version("ortools"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def profile_for(
    n: int, options: int, *, seed: int = 0, heavy: bool = True, spread: float = 0.5
) -> Profile:
    sizes = [1, 2, 4, 8, 16, 32, 64, 128] if options == 8 else [BATCH // 8]
    return synthetic_profile(
        n, batch_size=BATCH, microbatch_sizes=sizes, heavy_ends=heavy, spread=spread, seed=seed
    )


def speed(
    sizes: list[int], stages: list[int], time_limit: float, skip_cpsat_above: int
) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        for p in stages:
            if p > n:
                continue
            for k in (1, 8):
                prof = profile_for(n, k)
                clus = Cluster.homogeneous(p, MEMORY, LINK)
                row: dict[str, Any] = {"units": n, "stages": p, "m_options": k}
                t0 = time.perf_counter()
                dp = partition_dp(prof, clus, PlanOptions(checkpoint="except_last"))
                row["dp_s"] = time.perf_counter() - t0
                assert dp is not None
                row["dp_step_s"] = dp[2]
                if n * p > skip_cpsat_above:
                    row["cpsat_status"] = "skipped"
                else:
                    t0 = time.perf_counter()
                    res = partition_cpsat(
                        prof, clus, PlanOptions(checkpoint="except_last", time_limit_s=time_limit)
                    )
                    row["cpsat_s"] = time.perf_counter() - t0
                    assert res is not None
                    row["cpsat_status"] = "optimal" if res.optimal else "feasible"
                    row["cpsat_gap"] = res.gap
                    exact = evaluate(
                        prof,
                        clus,
                        PlanOptions(checkpoint="except_last"),
                        res.starts[1:],
                        res.m,
                        solver="cpsat",
                    )
                    row["cpsat_over_dp"] = exact.step_time_s / dp[2]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def quality(stages: list[int]) -> list[dict[str, Any]]:
    profiles = {
        "uniform-ish (spread 0.1)": {"spread": 0.1, "heavy": False},
        "log-normal (spread 0.5)": {"spread": 0.5, "heavy": False},
        "log-normal, heavy ends": {"spread": 0.5, "heavy": True},
        "wide (spread 1.0), heavy ends": {"spread": 1.0, "heavy": True},
    }
    rows = []
    for label, kw in profiles.items():
        prof = profile_for(200, 8, seed=1, **kw)  # type: ignore[arg-type]
        for p in stages:
            clus = Cluster.homogeneous(p, MEMORY, LINK)
            opt = SOLVERS["dp"](prof, clus, PlanOptions(checkpoint="except_last"))
            same_m = PlanOptions(checkpoint="except_last", microbatches=opt.microbatches)
            row: dict[str, Any] = {"profile": label, "stages": p, "m": opt.microbatches}
            row["optimum_ms"] = opt.step_time_s * 1e3
            for name in ("uniform", "params", "torchgpipe"):
                row[name] = SOLVERS[name](prof, clus, same_m).step_time_s / opt.step_time_s
            row["lower_bound"] = lower_bound(prof, clus, same_m) / opt.step_time_s
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], columns: list[str], fmt: dict[str, str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            cells.append("-" if v is None else format(v, fmt[c]) if c in fmt else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,500,1000,2000")
    ap.add_argument("--stages", default="4,16,64")
    ap.add_argument("--quality-stages", default="2,4,8,16,32")
    ap.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per instance")
    ap.add_argument(
        "--skip-cpsat-above", type=int, default=10**9, help="skip CP-SAT when n*p exceeds this"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="default: results.json, or versus.json for versus"
    )
    ap.add_argument("--only", choices=["speed", "quality", "versus", "auto"], default=None)
    ap.add_argument("--base", default="cfde80d", help="the commit whose DP --only versus times")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of --only versus")
    ap.add_argument(
        "--instances", default=None, help="--only versus: comma-separated instance indices"
    )
    args = ap.parse_args()
    info = machine()
    print(json.dumps(info), flush=True)
    out: dict[str, Any] = {"machine": info}
    try:
        if args.only in ("versus", "auto"):  # auto: this DP, except_last against auto
            only = None if args.instances is None else [int(i) for i in args.instances.split(",")]
            out["versus"] = versus(args.base, args.repeats, only, auto=args.only == "auto")
        if args.only is None or args.only == "speed":
            out["speed"] = speed(
                [int(s) for s in args.sizes.split(",")],
                [int(s) for s in args.stages.split(",")],
                args.time_limit,
                args.skip_cpsat_above,
            )
        if args.only is None or args.only == "quality":
            out["quality"] = quality([int(s) for s in args.quality_stages.split(",")])
    except PipeplanError as exc:
        sys.exit(f"error: {exc}")
    name = {"versus": "versus.json", "auto": "auto.json"}.get(args.only or "", "results.json")
    (args.out or Path(__file__).with_name(name)).write_text(json.dumps(out, indent=2) + "\n")
    if "versus" in out:
        print(
            markdown(
                out["versus"],
                [
                    "instance",
                    "base_s",
                    "new_s",
                    "speedup",
                    "speedup_min",
                    "speedup_max",
                    "base_status",
                    "new_status",
                    "new_over_base_step",
                ],
                {
                    "base_s": ".2f",
                    "new_s": ".3f",
                    "speedup": ".1f",
                    "speedup_min": ".1f",
                    "speedup_max": ".1f",
                    "new_over_base_step": ".6f",
                },
            )
        )
    if "speed" in out:
        print(
            markdown(
                out["speed"],
                [
                    "units",
                    "stages",
                    "m_options",
                    "dp_s",
                    "cpsat_s",
                    "cpsat_status",
                    "cpsat_gap",
                    "cpsat_over_dp",
                ],
                {"dp_s": ".2f", "cpsat_s": ".2f", "cpsat_gap": ".2%", "cpsat_over_dp": ".4f"},
            )
        )
    if "quality" in out:
        print(
            markdown(
                out["quality"],
                [
                    "profile",
                    "stages",
                    "m",
                    "optimum_ms",
                    "uniform",
                    "params",
                    "torchgpipe",
                    "lower_bound",
                ],
                {
                    "optimum_ms": ".1f",
                    "uniform": ".3f",
                    "params": ".3f",
                    "torchgpipe": ".3f",
                    "lower_bound": ".3f",
                },
            )
        )


if __name__ == "__main__":
    main()
