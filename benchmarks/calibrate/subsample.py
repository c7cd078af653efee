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
import itertools
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

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


def estimators(launches: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """How three ways of combining 3 launches' engine points spread over every draw of 3
    launches out of ``launches``: one line through all their points (what
    :func:`pipeplan.runtime.calibrate.combine` fits), one line through the widths' median
    points, and the median o and median k of each launch's own line.  5th percentile, median
    and 95th percentile of k and of the charge for a 10 ms stage."""
    from pipeplan.runtime.calibrate import combine, engine_points
    from pipeplan.runtime.engine_fit import fit_engine

    def per_launch(r: dict[str, Any]) -> list[tuple[float, float]]:
        widths = [e["width"] for e in r["engine"]]
        return engine_points(r, combine(2, [r], [], widths=widths)[0].link, widths)

    def pooled(draw: Sequence[dict[str, Any]], _: Any) -> tuple[float, float]:
        cluster, _c = combine(2, list(draw), [])
        return cluster.op_overhead_s, cluster.contention

    def median_points(_: Any, pts: Sequence[list[tuple[float, float]]]) -> tuple[float, float]:
        return fit_engine([
            (statistics.median(p[w][0] for p in pts), statistics.median(p[w][1] for p in pts))
            for w in range(len(pts[0]))
        ])  # fmt: skip

    def median_fits(_: Any, pts: Sequence[list[tuple[float, float]]]) -> tuple[float, float]:
        fits = [fit_engine(p) for p in pts]
        return statistics.median(f[0] for f in fits), statistics.median(f[1] for f in fits)

    lines = [
        "| launches as | combined by | k: p5 / median / p95 | 10 ms stage charged (ms) |",
        "|---|---|---|---|",
    ]
    for name in names:
        subs = [subsample(r, VARIANTS[name])[0] for r in launches]
        pts = [per_launch(r) for r in subs]
        for how, f in (("one line through all points", pooled),
                       ("one line through the widths' median points", median_points),
                       ("median of each launch's fit", median_fits)):  # fmt: skip
            out = [
                f([subs[i] for i in d], [pts[i] for i in d])
                for d in itertools.combinations(range(len(subs)), 3)
            ]
            ks = np.quantile([k for _, k in out], [0.05, 0.5, 0.95])
            c10 = np.quantile([charges(o * 1e6, k)[1] for o, k in out], [0.05, 0.5, 0.95])
            lines.append(
                f"| {name} | {how} | {' / '.join(f'{x:.3f}' for x in ks)} "
                f"| {' / '.join(f'{x:.2f}' for x in c10)} |"
            )
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
    print()
    print(estimators(launches, ["old (all)", "m 2,16, 3 steps, F+B 20 (now)"]))


if __name__ == "__main__":
    main()
