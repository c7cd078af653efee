"""How the engine's cost per operation depends on how long the operations are.

    .venv/bin/python -m benchmarks.accuracy.engine_sweep [--widths 256 512 1024] [--launches 2]

Runs ``pipeplan calibrate``'s engine measurement (2 ranks, 2 identical stages of two linear
layers, m = 2, 4, 8, 16, interleaved over rounds) with layers of several widths, so that one
stage's forward + backward F + B ranges from under a millisecond to several.  For each width it
prints F + B (timed alone), the slope of step time against m (Theil-Sen), and the excess of the
slope over F + B + C: what a micro-batch costs beyond its compute and transfer.  A fixed engine
cost per operation predicts a constant excess 2 o; the fit ``excess = 2 o + kappa (F + B)``
says how much of it grows with the operations instead.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from pipeplan.runtime.calibrate import measure
from pipeplan.runtime.engine_fit import MICRO, fit_engine, slope_per_microbatch
from pipeplan.runtime.linkbench import fit_link


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for _ in range(args.launches):  # every launch measures every width, interleaved
        r = measure(2, "cpu", 65536, args.repeats, None, 600.0, args.widths)
        link = fit_link([tuple(s) for s in r["samples"]])  # type: ignore[misc]
        for e in r["engine"]:
            trip = 2 * link.transfer_s(4 * e["width"] * MICRO)
            slope = slope_per_microbatch({int(m): ts for m, ts in e["steps"].items()})
            rows.append((e["width"], e["compute"], slope, slope - e["compute"] - trip))
    print("| width | F + B (ms) | slope per micro-batch (ms) | excess (ms) | excess / (F + B) |")
    print("|---:|---:|---:|---:|---:|")
    for width in args.widths:
        mine = [x for x in rows if x[0] == width]
        fb, slope, excess = (statistics.median(x[k] for x in mine) for k in (1, 2, 3))
        print(f"| {width} | {fb * 1e3:.2f} | {slope * 1e3:.2f} | {excess * 1e3:.2f} | "
              f"{excess / fb:.2f} |")  # fmt: skip
    fb_all = np.array([x[1] for x in rows])
    excess_all = np.array([x[3] for x in rows])
    kappa, two_o = np.polyfit(fb_all, excess_all, 1)
    print(
        f"\nfit over {len(rows)} points: excess = 2 x {two_o / 2 * 1e3:.2f} ms "
        f"+ {kappa:.2f} x (F + B)"
    )
    o, k = fit_engine([(x[1], x[1] + x[3]) for x in rows])  # (F + B, slope - C)
    print(f"calibrate's model, slope - C = (1 + k)(F + B + 2 o): o = {o * 1e3:.2f} ms, k = {k:.2f}")


if __name__ == "__main__":
    main()
