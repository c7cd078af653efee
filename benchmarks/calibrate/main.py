"""``pipeplan calibrate --nproc 2``: how long it takes and how steady its figures are, before and
after its defaults changed.

Before: the old defaults (3 launches of 2 ranks, 3 launches of 1 rank, 20 repeats of everything,
the engine at m = 2, 4, 8, 16), run once;
besides the cluster they make together (medians over launches), each 2-rank launch paired with
one 1-rank launch gives its own figures: their range is the launch-to-launch spread.  After:
the current defaults, ``--runs`` complete calibrations, each timed.  Every launch records when
each of its phases ended (the progress bar's events), so the table says where the time goes.

    PYTHONPATH=. .venv/bin/python -m benchmarks.calibrate.main --runs 3    # about 20 minutes
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine

HERE = Path(__file__).parent
RAW = HERE / "raw.json"
OLD_LAUNCHES, OLD_SOLO, OLD_REPEATS, OLD_WIDTHS = 3, 3, 20, (256, 512, 1024, 1536)
OLD_MS = (2, 4, 8, 16)
OLD = {"launches": OLD_LAUNCHES, "solo_launches": OLD_SOLO, "repeats": OLD_REPEATS,
       "engine_repeats": OLD_REPEATS, "widths": OLD_WIDTHS, "ms": OLD_MS}  # fmt: skip


def figures(cluster: Any) -> dict[str, float | None]:
    """What a cluster file says about this machine, in the units the table prints."""
    return {
        "latency_us": cluster.link.latency_s * 1e6,
        "bandwidth_GBps": (cluster.link.bandwidth_Bps or 0) / 1e9,
        "allreduce_ms_per_MiB": cluster.allreduce_s(2**20) * 1e3,
        "engine_us": cluster.op_overhead_s * 1e6,
        "contention": cluster.contention,
        "update_contention": cluster.update_contention,
        "engine_alone_us": (cluster.solo_op_overhead_s or 0) * 1e6,
        "step_us": cluster.step_overhead_s * 1e6,
    }


def _launch(nproc: int) -> tuple[dict[str, Any], dict[str, float]]:
    """One launch with the old defaults, and when each of its phases ended (s from its start)."""
    from pipeplan.runtime.calibrate import measure

    start, ends = time.monotonic(), {}

    def done(phase: str) -> None:
        ends[phase] = time.monotonic() - start

    result = measure(nproc, "cpu", 16 * 2**20, OLD_REPEATS, None, 600.0, OLD_WIDTHS, done,
                     OLD_REPEATS, OLD_MS)  # fmt: skip
    ends["exit"] = time.monotonic() - start
    return result, ends


def before() -> dict[str, Any]:
    from pipeplan.runtime.calibrate import combine

    start = time.monotonic()
    pairs = [_launch(2) for _ in range(OLD_LAUNCHES)]
    solos = [_launch(1) for _ in range(OLD_SOLO)]
    wall = time.monotonic() - start
    widths = OLD_WIDTHS
    together, _ = combine(2, [r for r, _ in pairs], [r for r, _ in solos], widths=widths)
    each = [
        combine(2, [r], [a], widths=widths)[0] for (r, _), (a, _) in zip(pairs, solos, strict=True)
    ]
    RAW.write_text(
        json.dumps((json.loads(RAW.read_text()) if RAW.exists() else []) + [r for r, _ in pairs])
        + "\n"
    )  # every timing of the 2-rank launches, for subsample.py
    return {
        "wall_s": wall,
        "figures": figures(together),
        "launches": [figures(c) for c in each],
        "phases": [e for _, e in pairs] + [e for _, e in solos],
    }


def after(runs: int) -> dict[str, Any]:
    from pipeplan.runtime.calibrate import calibrate

    out: dict[str, Any] = {"wall_s": [], "figures": []}
    for _ in range(runs):
        start = time.monotonic()
        cluster, _ = calibrate(2)
        out["wall_s"].append(time.monotonic() - start)
        out["figures"].append(figures(cluster))
        print(json.dumps({"after": out["figures"][-1], "wall_s": out["wall_s"][-1]}), flush=True)
    return out


def table(res: dict[str, Any]) -> str:
    runs, new = res["before"], res["after"]
    lines = [
        (
            f"| figure | before: {len(runs)} calibrations (3-launch medians) "
            f"| before: each launch (range) | after: {len(new['figures'])} calibrations "
            "| after within the launches' range |"
        ),
        "|---|---:|---:|---:|---|",
    ]
    for key in runs[0]["figures"]:
        each = [f[key] for run in runs for f in run["launches"]]
        lo, hi = min(each), max(each)
        now = [f[key] for f in new["figures"]]
        inside = sum(lo <= x <= hi for x in now)
        medians = ", ".join(f"{run['figures'][key]:.3g}" for run in runs)
        lines.append(
            f"| {key} | {medians} | {lo:.3g}-{hi:.3g} "
            f"| {', '.join(f'{x:.3g}' for x in now)} | {inside} of {len(now)} |"
        )
    old_walls = ", ".join(f"{run['wall_s']:.0f}" for run in runs)
    walls = ", ".join(f"{w:.0f}" for w in new["wall_s"])
    lines += ["", f"Wall time: before {old_walls} s; after {walls} s."]
    return "\n".join(lines)


def main() -> None:
    from pipeplan.runtime.calibrate import SOLO_MS, SOLO_WIDTHS, calibrate
    from pipeplan.runtime.engine_fit import ENGINE_MS

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="calibrations with today's defaults")
    ap.add_argument("--only", choices=["before", "after"], help="one part, kept beside the other")
    ap.add_argument("-o", "--output", default=str(HERE / "results.json"))
    args = ap.parse_args()
    out = Path(args.output)
    res = json.loads(out.read_text()) if args.only and out.exists() else {}
    defaults = {
        k: str(v.default)
        for k, v in inspect.signature(calibrate).parameters.items()
        if k in ("launches", "solo_launches", "repeats", "engine_repeats", "widths")
    }
    new = {**defaults, "ms": str(ENGINE_MS), "solo": f"widths {SOLO_WIDTHS}, m {SOLO_MS}"}
    res.update({"machine": machine(), "old": OLD, "new": new})
    if args.only != "after":  # each run of the old defaults is kept beside earlier ones
        res.setdefault("before", []).append(before())
        print(json.dumps(res["before"][-1]), flush=True)
    if args.only != "before":
        new_runs = after(args.runs)
        kept = res.setdefault("after", {"wall_s": [], "figures": []})
        for key in ("wall_s", "figures"):
            kept[key] += new_runs[key]
    out.write_text(json.dumps(res, indent=1) + "\n")
    if "before" in res and "after" in res:
        print(table(res))


if __name__ == "__main__":
    main()
