"""The accuracy benchmark's own repeatability: how far the two halves of one run disagree.

    .venv/bin/python -m benchmarks.accuracy.noise benchmarks/accuracy/results/run17-rounds.csv

Round r of a configuration gives the ratio q_r = measured_r / bracketed_r: the round's median
step over the mean of the predictions from the profiles taken just before and just after it.
The bracketed error of the configuration is median_r(q_r) - 1.  With the rounds split into a
first and a second half,

    split = |mean(q, first half) / mean(q, second half) - 1|

is how far the same plan, predicted from the same kind of profile and measured the same way,
moved between the halves of one run: the noise floor.  A cost model whose errors are within the
split cannot be told from an exact one by this benchmark.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

CONFIG = ["model", "stages", "m", "checkpoint"]


def split_halves(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: ``split`` (above), ``spread`` (max q / min q - 1) and ``error``
    (|median q - 1|, the bracketed error), from a ``rounds.csv`` frame (columns ``round``,
    ``measured_ms``, ``before_ms``, ``after_ms`` and the configuration's)."""
    q = rounds.assign(q=rounds["measured_ms"] / ((rounds["before_ms"] + rounds["after_ms"]) / 2))
    rows = []
    for key, group in q.sort_values("round").groupby(CONFIG, sort=False):
        v = group["q"].to_numpy()
        half = len(v) // 2
        if half == 0:
            continue
        first, second = float(np.mean(v[:half])), float(np.mean(v[len(v) - half :]))
        rows.append(
            {
                **dict(zip(CONFIG, key, strict=True)),
                "split": abs(first / second - 1),
                "spread": float(v.max() / v.min() - 1),
                "error": abs(float(np.median(v)) - 1),
            }
        )
    return pd.DataFrame(rows)


def summary(halves: pd.DataFrame, limit: float = 0.15) -> dict[str, float]:
    """Median, 90th percentile and worst split, and how many configurations' split and error
    exceed ``limit``."""
    return {
        "configurations": len(halves),
        "split_median": float(halves["split"].median()),
        "split_p90": float(halves["split"].quantile(0.9)),
        "split_worst": float(halves["split"].max()),
        "split_over": int((halves["split"] > limit).sum()),
        "error_over": int((halves["error"] > limit).sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", nargs="+", type=Path, help="rounds.csv files of accuracy runs")
    ap.add_argument("--limit", type=float, default=0.15)
    args = ap.parse_args()
    rows = []
    for path in args.rounds:
        s = summary(split_halves(pd.read_csv(path)), args.limit)
        rows.append({"run": path.name, **s})
    print(pd.DataFrame(rows).round(3).to_string(index=False))


if __name__ == "__main__":
    main()
