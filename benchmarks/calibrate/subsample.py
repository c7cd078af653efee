"""Which of the 2-minute calibration's cuts moves the engine fit (o, k): one launch's raw timings,
subsampled.

Runs ``--launches`` 2-rank launches with the old engine defaults (20 steps per point, m = 2, 4,
8, 16, widths 256-1536, F + B timed 20 times per round), keeps every timing (``raw.json``), and
refits each launch's (o, k) as a cheaper calibration would have seen the same launch: fewer
micro-batch counts, the first few steps per point, the first few F + B passes, fewer widths.
The same launch under each variant is a paired comparison: the host's drift between launches
drops out.

    PYTHONPATH=. .venv/bin/python -m benchmarks.calibrate.subsample --launches 3   # ~7 min
    PYTHONPATH=. .venv/bin/python -m benchmarks.calibrate.subsample --analyse      # raw.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OLD_MS, OLD_WIDTHS, OLD_REPEATS = (2, 4, 8, 16), (256, 512, 1024, 1536), 20

#: name: (micro-batch counts, steps per point, F + B passes per round, widths, rounds)
Variant = tuple[tuple[int, ...], int, int, tuple[int, ...], int]
VARIANTS: dict[str, Variant] = {
    "old (all)": (OLD_MS, 20, 20, OLD_WIDTHS, 3),
    "m 2-8, 4 steps, F+B 4 (2026-11-25)": ((2, 4, 8), 4, 4, OLD_WIDTHS, 3),
    "m 2-8, 20 steps, F+B 4": ((2, 4, 8), 20, 4, OLD_WIDTHS, 3),
    "m 2-16, 4 steps, F+B 4": (OLD_MS, 4, 4, OLD_WIDTHS, 3),
    "m 2-8, 4 steps, F+B 20": ((2, 4, 8), 4, 20, OLD_WIDTHS, 3),
    "m 2,16, 3 steps, F+B 20 (now)": ((2, 16), 3, 20, OLD_WIDTHS, 3),
    "m 2,16, 4 steps, F+B 20": ((2, 16), 4, 20, OLD_WIDTHS, 3),
    "m 2,16, 6 steps, F+B 20": ((2, 16), 6, 20, OLD_WIDTHS, 3),
    "m 2,16, 8 steps, F+B 20, w 256,1536": ((2, 16), 8, 20, (256, 1536), 3),
}


def subsample(result: dict[str, Any], variant: Variant) -> tuple[dict[str, Any], float]:
    """The launch's result as a launch measuring only this much would have returned it, and
    about how long that launch's engine phase would have run (its steps, the 2 warm-up steps
    per point taken as long as the median, and its F + B passes)."""
    ms, steps, passes, widths, rounds = variant
    engine, seconds = [], 0.0
    for e in result["engine"]:
        if e["width"] not in widths:
            continue
        raw = e["raw"]
        kept = {
            str(m): [statistics.median(r[:steps]) for r in raw["steps"][str(m)][:rounds]]
            for m in ms
        }
        per_round = [statistics.median(r[:passes]) for r in raw["compute"][:rounds]]
        engine.append({"width": e["width"], "compute": statistics.median(per_round),
                       "steps": kept})  # fmt: skip
        seconds += sum((steps + 2) * t for ts in kept.values() for t in ts)
        seconds += sum((passes + 3) * t for t in per_round)
    return {**result, "engine": engine}, seconds


def fits(launches: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float, float]]]:
    """Per variant, each launch's (o in µs, k, engine seconds)."""
    from pipeplan.runtime.calibrate import combine

    out: dict[str, list[tuple[float, float, float]]] = {}
    for name, variant in VARIANTS.items():
        row = []
        for r in launches:
            sub, seconds = subsample(r, variant)
            cluster, _ = combine(2, [sub], [], widths=variant[3])
            row.append((cluster.op_overhead_s * 1e6, cluster.contention, seconds))
        out[name] = row
    return out


def charges(o_us: float, kappa: float) -> list[float]:
    """What (o, k) charges per micro-batch, (1 + k)(F + B + 2 o), for stages of F + B = 1, 10
    and 40 ms (ms)."""
    return [(1 + kappa) * (x + 2 * o_us / 1e3) for x in (1.0, 10.0, 40.0)]


def report(launches: Sequence[dict[str, Any]]) -> str:
    """Per variant: each launch's (o, k), and how far its charges for 1, 10 and 40 ms stages
    land from the full measurement's on the same launch (median and worst over launches)."""
    table = fits(launches)
    full = table["old (all)"]
    lines = [
        (
            "| variant | engine s per launch | o per launch (µs) | k per launch "
            "| charge vs all, 1 / 10 / 40 ms stages: median (worst) |"
        ),
        "|---|---:|---|---|---|",
    ]
    for name, row in table.items():
        o = ", ".join(f"{x:.0f}" for x, _, _ in row)
        k = ", ".join(f"{y:.3f}" for _, y, _ in row)
        s = statistics.median(z for _, _, z in row)
        cells = []
        for i in range(3):
            rel = [charges(a, b)[i] / charges(c, d)[i] - 1 for (a, b, _), (c, d, _) in
                   zip(row, full, strict=True)]  # fmt: skip
            worst = max(rel, key=abs)
            cells.append(f"{statistics.median(rel):+.1%} ({worst:+.1%})")
        lines.append(f"| {name} | {s:.1f} | {o} | {k} | {' / '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--analyse", action="store_true", help="refit raw.json, launch nothing")
    ap.add_argument("-o", "--output", default=str(HERE / "raw.json"))
    args = ap.parse_args()
    out = Path(args.output)
    launches: list[dict[str, Any]] = json.loads(out.read_text()) if out.exists() else []
    if not args.analyse:
        from pipeplan.runtime.calibrate import measure

        for _ in range(args.launches):
            result = measure(
                2,
                "cpu",
                16 * 2**20,
                OLD_REPEATS,
                None,
                900.0,
                OLD_WIDTHS,
                None,
                OLD_REPEATS,
                OLD_MS,
            )
            launches.append(result)
            out.write_text(json.dumps(launches) + "\n")
            print(f"launch {len(launches)} kept", flush=True)
    print(report(launches))


if __name__ == "__main__":
    main()
